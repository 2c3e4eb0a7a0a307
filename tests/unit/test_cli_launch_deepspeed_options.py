"""DeepSpeed launcher options of `zeroshard launch` beyond the basic ones: --bind_cores_to_rank/--bind_core_list
([Note: binding cores to ranks]), --save_pid, --force_multi, --no_ssh, and one line for those it has no use for
(--launcher other than pdsh, --launcher_args, --autotuning)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from zeroshard.cli.main import main
from zeroshard.launcher import LaunchOptions, single_node
from zeroshard.launcher.bind import CoreListError, available_cores, bound_command, memory_node, parse_core_list, share

SHOW = (  # one write per line: workers of one node share the output
    "import glob, json, os, sys\n"
    "seen = [int(os.environ['RANK']), sorted(os.sched_getaffinity(0)), os.environ.get('OMP_NUM_THREADS'), "
    "sys.argv[1:], glob.glob('/tmp/*.deepspeed')]\n"
    "os.write(1, ('SEEN ' + json.dumps(seen) + '\\n').encode())\n"
)
LAUNCH = [sys.executable, "-m", "zeroshard.cli.main", "launch"]


def _launch(tmp_path, *argv: str) -> tuple[subprocess.CompletedProcess[str], dict[int, list]]:
    (tmp_path / "show.py").write_text(SHOW)
    ran = subprocess.run([*LAUNCH, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    seen = {}
    for line in ran.stdout.splitlines():
        if line.startswith("SEEN "):
            rank, *rest = json.loads(line[5:])
            seen[rank] = rest
    return ran, seen


def test_core_lists_are_read_and_shared_out_as_deepspeeds():
    assert parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7]
    for bad in ("1,x", "5-3", "-1", "", "0-2,1", "0,2-6,5-9", "8,2-6", "1,0"):  # DeepSpeed's: ascending, apart
        with pytest.raises(CoreListError, match="--bind_core_list"):
            parse_core_list(bad)
    cores = list(range(10))
    assert [share(cores, r, 3) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # core 9 left over
    with pytest.raises(CoreListError, match="1 core"):
        share([4], 0, 2)
    assert bound_command([0, 1, 2, 5], ["python", "x.py"], None) == ["python", "x.py"]
    node = memory_node([0])  # this machine's first core is on some memory node
    where = ["-m", str(node)] if node is not None else []
    assert bound_command([0], ["python"], "/usr/bin/numactl") == ["/usr/bin/numactl", *where, "-C", "0", "python"]
    assert bound_command([0, 1, 2, 5], ["p"], "numactl")[-3:] == ["-C", "0-2,5", "p"]


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by launcher options: the other tests of
# this file
@pytest.mark.slow
def test_each_worker_runs_on_its_own_share_of_the_cores_and_the_pid_is_saved(tmp_path, capsys):
    """One real launch with --bind_cores_to_rank, --save_pid and --force_multi: each worker's affinity is its share
    (by local rank) and OMP_NUM_THREADS its size, with DeepSpeed's argv; the launcher's pid is in /tmp/<pid>.deepspeed
    while it runs, removed at the end; the one host ran as a node (its dry run)."""
    assert main(["launch", "--force_multi", "--nproc_per_node", "2", "--dry-run", "s.py"]) == 0
    first, command = capsys.readouterr().out.splitlines()
    assert first == "# node 0: localhost, 2 process(es)" and "--nnodes 1 --node_rank 0" in command
    cores = available_cores()
    nproc = 2 if len(cores) >= 2 else 1
    launch = ["--force_multi", "--save_pid", "--nproc_per_node", str(nproc), "--bind_cores_to_rank"]
    ran, seen = _launch(tmp_path, *launch, "show.py", "a b")
    assert ran.returncode == 0, ran.stderr
    pid = int(ran.stdout.splitlines()[0].removeprefix("launcher pid: "))
    for rank in range(nproc):
        mine = share(cores, rank, nproc)
        assert seen[rank][:3] == [mine, str(len(mine)), [f"--local_rank={rank}", "a b"]], seen
        assert f"/tmp/{pid}.deepspeed" in seen[rank][3]
    assert not os.path.exists(f"/tmp/{pid}.deepspeed")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bind_core_list", "0,x"], "--bind_core_list '0,x': expected numbers and ranges like 1,3-5,7"),
        (["--bind_core_list", "0-4095"], "core(s) [" + ", ".join(map(str, range(len(os.sched_getaffinity(0)), 20)))),
        (["--nproc_per_node", "2", "--bind_core_list", "0"], "1 core(s) (0) for 2 processes on this node"),
        (["--force_multi", "--bind_core_list", "0-4095"], "are not this machine's to run on"),
        (["--launcher", "slurm"], "--launcher slurm: zeroshard launch starts a hostfile's nodes over ssh itself"),
        (["--launcher_args=-x"], "--launcher_args: there is no pdsh or mpirun command line here"),
        (
            ["--autotuning", "run"],
            "--autotuning run: DeepSpeed's autotuning through the launcher is `zeroshard autotune",
        ),
        (["--no_ssh"], "--no_ssh starts only this node of a hostfile's: pass --hostfile and --node_rank"),
    ],
)
def test_options_it_cannot_follow_are_refused_in_one_line(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.py").write_text("")
    assert main(["launch", *argv, "s.py"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_no_ssh_starts_only_its_own_node_of_the_hostfile(tmp_path, capsys):
    """DeepSpeed's --no_ssh: every node runs the same command with its own --node_rank (here both on this machine)."""
    (tmp_path / "hosts").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    hosts = str(tmp_path / "hosts")
    assert main(["launch", "--no_ssh", "-H", hosts, "--node_rank", "1", "--dry-run", "s.py"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[argv.index("--nnodes") :][:8] == [
        *("--nnodes", "2", "--node_rank", "1"),
        *("--master_addr", "localhost", "--master_port", "29500"),
    ]
    assert main(["launch", "--no_ssh", "-H", hosts, "--node_rank", "2", "s.py"]) == 2
    assert "pass --node_rank in 0..1" in capsys.readouterr().err


@pytest.mark.slow  # (two launchers rendezvous: ~15 s here; the command each runs is checked above)
def test_no_ssh_nodes_started_one_by_one_train_together(tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    hosts = str(tmp_path / "hosts")
    (tmp_path / "show.py").write_text(SHOW)
    last = available_cores()[-1]
    both = [
        subprocess.Popen(
            [*LAUNCH, "--no_ssh", "-H", hosts, "--node_rank", str(r), "--master_port", "29733"]
            + ["--bind_core_list", str(last), "show.py", f"n{r}"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in both]
    assert [p.returncode for p in both] == [0, 0], outs
    seen = [json.loads(line[5:]) for out, _ in outs for line in out.splitlines() if line.startswith("SEEN ")]
    assert sorted((rank, argv) for rank, _, _, argv, _ in seen) == [
        (0, ["--local_rank=0", "n0"]),
        (1, ["--local_rank=0", "n1"]),
    ]
    assert all(cores == [last] and threads == "1" for _, cores, threads, _, _ in seen), seen  # (--bind_core_list)


def test_bind_cores_reaches_every_node_of_a_hostfile(tmp_path):
    """A hostfile's nodes each split their own cores: the worker command carries the core list, not a share."""
    opts = LaunchOptions("show.py", [], local_rank_arg=True, bind_cores="all")
    worker = single_node(opts, 2)[-1 - 1]
    assert "/zeroshard/launcher/bind.py all -- " in worker, worker


def test_a_batch_script_passes_the_binding_on(capsys):
    assert main(["launch", "--print-sbatch", "--nnodes", "2", "--bind_core_list", "0-3", "s.py"]) == 0
    assert "--bind_core_list 0-3 s.py" in capsys.readouterr().out


def test_an_unresolvable_master_addr_is_named_not_waited_on_silently(caplog):
    import logging

    from zeroshard.cli.launch import warn_if_unresolvable

    logging.getLogger("zeroshard").addHandler(caplog.handler)  # zeroshard's logger does not propagate
    try:
        warn_if_unresolvable("localhost")
        assert not caplog.records
        warn_if_unresolvable("no-such-host.invalid")
        warn_if_unresolvable("bad..host")
    finally:
        logging.getLogger("zeroshard").removeHandler(caplog.handler)
    assert "--master_addr no-such-host.invalid does not resolve here" in caplog.text
    assert "--master_addr bad..host does not resolve here" in caplog.text


def test_a_remote_nodes_worker_refuses_cores_it_does_not_have(tmp_path):
    """A hostfile's other nodes check their own cores in each worker: one line, exit 2 (a traceback from
    sched_setaffinity before, or a silent bind to the valid part with OMP_NUM_THREADS counting the whole list)."""
    import zeroshard.launcher.bind as bind

    env = {**os.environ, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    ran = subprocess.run(
        [sys.executable, "-S", bind.__file__, "0-4095", "--", sys.executable, "-c", "print('ran')"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 2 and "ran" not in ran.stdout, ran
    assert ran.stderr.startswith("zeroshard launch: --bind_core_list 0-4095: core(s) [") and ran.stderr.count("\n") == 1
