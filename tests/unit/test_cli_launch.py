"""`zeroshard launch`: hostfiles, --include/--exclude, and the per-node torchrun commands (--dry-run)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from zeroshard.cli.main import main
from zeroshard.launcher import LaunchOptions, multi_node, single_node
from zeroshard.launcher.hostfile import LaunchError, limit_resources, parse_hostfile, read_hostfile, select_resources
from zeroshard.launcher.plan import exported_environment
from zeroshard.launcher.runner import thread_env

HOSTFILE = """
# a comment line
worker-0 slots=4   # trailing comment

worker-1 slots=2
"""


def test_hostfile_in_deepspeed_format():
    assert parse_hostfile(HOSTFILE) == {"worker-0": 4, "worker-1": 2}
    assert parse_hostfile("worker-0 slots=2 max_slots=4\n") == {"worker-0": 2}  # OpenMPI's, as DeepSpeed reads it
    assert parse_hostfile("w slots=2 max-slots=4 extra=3\nv slots=1 max_slots\n") == {"w": 2, "v": 1}  # as DeepSpeed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("worker-0 slots=4\nworker-1 4\n", "hosts line 2: expected 'HOST slots=N'"),
        ("worker-0 slots=-1\n", "hosts line 1: slots=-1 must be a whole number"),
        ("worker-0 slots=x\n", "hosts line 1: slots=x"),
        ("a slots=1\nb slots=1\na slots=2\n", "hosts line 3: host a is listed twice (first on line 1)"),
        ("# nothing\n\n", "lists no hosts"),
    ],
)
def test_hostfile_errors_name_the_file_and_line(text, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        parse_hostfile(text, "hosts")


def test_a_host_with_slots_0_stays_out_of_the_launch():
    # DeepSpeed's parser takes slots=0 and its filter removes hosts without slots (before, refused here)
    hosts = parse_hostfile("worker-0 slots=2\nworker-1 slots=0\n")
    assert select_resources(hosts) == {"worker-0": [0, 1]}
    assert select_resources(hosts, exclude="worker-0:0") == {"worker-0": [1]}
    assert select_resources(hosts, include="worker-0@worker-1") == {"worker-0": [0, 1]}
    with pytest.raises(LaunchError, match=re.escape("worker-1 has no slots (slots=0), not [0]")):
        select_resources(hosts, include="worker-1:0")
    with pytest.raises(LaunchError, match="leaves no slots to run on"):
        select_resources(hosts, include="worker-1")
    with pytest.raises(LaunchError, match=re.escape("the hostfile leaves no slots to run on (every host has slots=0)")):
        select_resources(parse_hostfile("worker-0 slots=0\n"))


def test_read_hostfile_missing_file(tmp_path):
    with pytest.raises(LaunchError, match="cannot be read"):
        read_hostfile(tmp_path / "nope")


def test_include_exclude_filters():
    hosts = parse_hostfile(HOSTFILE)
    assert select_resources(hosts, include="worker-1") == {"worker-1": [0, 1]}
    assert select_resources(hosts, include="worker-0:0,2@worker-1") == {"worker-0": [0, 2], "worker-1": [0, 1]}
    assert select_resources(hosts, exclude="worker-0:1") == {"worker-0": [0, 2, 3], "worker-1": [0, 1]}
    assert select_resources(hosts, exclude="worker-1") == {"worker-0": [0, 1, 2, 3]}
    # a host named twice: the union of its slots, as DeepSpeed merges them (the last one was kept)
    assert select_resources(hosts, include="worker-0:0,1@worker-0:1") == {"worker-0": [0, 1]}
    assert select_resources(hosts, include="worker-0:1@worker-0") == {"worker-0": [1]}
    assert select_resources(hosts, exclude="worker-0:0@worker-0:1") == {"worker-0": [2, 3], "worker-1": [0, 1]}
    with pytest.raises(LaunchError, match="not in the hostfile"):
        select_resources(hosts, include="worker-9")
    with pytest.raises(LaunchError, match="slots 0-1, not \\[5\\]"):
        select_resources(hosts, include="worker-1:5")
    with pytest.raises(LaunchError, match="cannot be used together"):
        select_resources(hosts, include="worker-1", exclude="worker-0")
    assert limit_resources(select_resources(hosts), nnodes=1, nproc_per_node=2) == {"worker-0": [0, 1]}
    with pytest.raises(LaunchError, match="--nnodes 3"):
        limit_resources(select_resources(hosts), nnodes=3, nproc_per_node=None)


def test_single_node_commands():
    argv = single_node(LaunchOptions("train.py", ["--lr", "1"]), nproc=2)
    assert argv[1:] == [
        "-m",
        "zeroshard.launcher.torchrun",
        "--nproc_per_node",
        "2",
        "--standalone",
        "--max_restarts",
        "0",
        "train.py",
        "--lr",
        "1",
    ]
    module = single_node(LaunchOptions("zeroshard.cli.train", module=True, master_port=1234), nproc=2)
    assert module[module.index("--master_addr") + 1] == "127.0.0.1" and "--standalone" not in module
    assert module[module.index("--master_port") + 1] == "1234" and module[-2:] == ["-m", "zeroshard.cli.train"]
    with pytest.raises(LaunchError, match="--node_rank"):
        single_node(LaunchOptions("t.py", nnodes=2), nproc=1)


def test_multi_node_static_and_elastic_rendezvous():
    resources = {"worker-0": [0, 1], "worker-1": [1, 3]}
    static = multi_node(LaunchOptions("train.py", ["--x"]), resources, {"NCCL_DEBUG": "INFO"})
    assert [n.node_rank for n in static] == [0, 1] and all(n.remote for n in static)
    argv = static[1].argv
    assert argv[argv.index("--node_rank") + 1] == "1" and argv[argv.index("--master_addr") + 1] == "worker-0"
    assert static[1].env == {"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "1,3"}
    assert "CUDA_VISIBLE_DEVICES" not in static[0].env
    command = static[1].full_argv("/work dir")
    assert command[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30"] and command[5] == "worker-1"
    threads = '{ t=$(( $(nproc) / 2 )); [ "$t" -ge 1 ] || t=1; export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$t}"; } && '
    assert command[6].startswith(f"cd '/work dir' && {threads}env CUDA_VISIBLE_DEVICES=1,3 NCCL_DEBUG=INFO ")
    # as run_nodes runs it, torchrun watches its input ([Note: stopping remote nodes]); --dry-run prints it without
    watched = static[1].full_argv("/work dir", watch_input=True)[6]
    assert "NCCL_DEBUG=INFO ZEROSHARD_STOP_WHEN_INPUT_CLOSES=1 " in watched and "STOP_WHEN" not in command[6]
    elastic = multi_node(LaunchOptions("train.py", max_restarts=3, master_port=7000), resources, {})
    argv = elastic[0].argv
    assert "--node_rank" not in argv and argv[argv.index("--rdzv_endpoint") + 1] == "worker-0:7000"
    assert argv[argv.index("--max_restarts") + 1] == "3"


def test_exported_environment_reads_env_files(tmp_path):
    (tmp_path / ".deepspeed_env").write_text("# comment\nFOO=bar\nNCCL_IB_DISABLE=1\n")
    env = exported_environment(
        {"NCCL_DEBUG": "WARN", "HOME": "/root", "PYTHONPATH": "/x"}, str(tmp_path), "/nonexistent"
    )
    assert env == {"NCCL_DEBUG": "WARN", "PYTHONPATH": "/x", "FOO": "bar", "NCCL_IB_DISABLE": "1"}
    (tmp_path / "cluster.env").write_text("FROM_DS_ENV_FILE=1\n")  # DeepSpeed's DS_ENV_FILE names another file
    env = exported_environment({"DS_ENV_FILE": "cluster.env", "MLFLOW_TRACKING_URI": "u"}, str(tmp_path), "/none")
    assert env == {"FROM_DS_ENV_FILE": "1", "MLFLOW_TRACKING_URI": "u"}
    (tmp_path / ".zeroshard_env").write_text("oops\n")
    with pytest.raises(LaunchError, match="line 1: expected KEY=VALUE"):
        exported_environment({}, str(tmp_path), "/nonexistent")


def test_thread_env_splits_the_cores():
    assert thread_env(1, {}) == {} and thread_env(2, {"OMP_NUM_THREADS": "3"}) == {}
    assert int(thread_env(2, {})["OMP_NUM_THREADS"]) >= 1


def test_dry_run_prints_one_command_per_node(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text(HOSTFILE)
    code = main(
        ["launch", "--hostfile", str(hostfile), "--exclude", "worker-0:3", "--dry-run", "train.py", "--lr", "1e-4"]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# node 0: worker-0, 3 process(es)" and lines[2] == "# node 1: worker-1, 2 process(es)"
    node1 = shlex.split(lines[3])
    assert node1[:6] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "worker-1"]
    remote = shlex.split(node1[6])
    assert remote[remote.index("--nnodes") + 1] == "2" and remote[remote.index("--node_rank") + 1] == "1"
    worker = f'exec {shlex.quote(sys.executable)} -u train.py --local_rank="$LOCAL_RANK" "$@"'
    assert remote[-7:] == ["--no_python", "/bin/sh", "-c", worker, "zeroshard-worker", "--lr", "1e-4"]


def test_dry_run_single_node_and_module(capsys):
    assert (
        main(["launch", "--nproc_per_node", "2", "--dry-run", "-m", "zeroshard.cli.train", "--model", "tiny-llama"])
        == 0
    )
    argv = shlex.split(capsys.readouterr().out)
    worker = f'exec {shlex.quote(sys.executable)} -u -m zeroshard.cli.train --local_rank="$LOCAL_RANK" "$@"'
    assert argv[argv.index("--nproc_per_node") + 1] == "2"
    assert argv[-4:] == [worker, "zeroshard-worker", "--model", "tiny-llama"]
    assert main(["launch", "--dry-run", "--no_local_rank", "-m", "zeroshard.cli.train", "--model", "m"]) == 0
    assert shlex.split(capsys.readouterr().out)[-4:] == ["-m", "zeroshard.cli.train", "--model", "m"]


ARGV_SCRIPT = "import json, os, sys; print(json.dumps([os.environ['LOCAL_RANK'], sys.argv]))\n"
TRICKY = ["--x", "a b", "$HOME", "'q'", '"$LOCAL_RANK"', "--local_rank=7", ""]


@pytest.mark.parametrize("how", ["script", "module", "no_python"])
def test_each_worker_runs_the_command_line_deepspeeds_launcher_gives_it(how, tmp_path):
    """[Note: the --local_rank argument]: `python -u script --local_rank=N ARGS` with the worker's own N, the arguments
    passed untouched (the worker's shell runs here as torchrun would start it, with LOCAL_RANK set)."""
    (tmp_path / "show.py").write_text(ARGV_SCRIPT)
    script = {"script": "show.py", "module": "show", "no_python": str(tmp_path / "show")}[how]
    if how == "no_python":
        (tmp_path / "show").write_text(f"#!{sys.executable}\n{ARGV_SCRIPT}")
        (tmp_path / "show").chmod(0o755)
    opts = LaunchOptions(script, TRICKY, module=how == "module", no_python=how == "no_python", local_rank_arg=True)
    argv = single_node(opts, nproc=2)
    worker = argv[argv.index("--no_python") + 1 :]
    for rank in ("0", "1"):
        ran = subprocess.run(worker, cwd=tmp_path, env={**os.environ, "LOCAL_RANK": rank}, capture_output=True)
        seen_rank, seen = json.loads(ran.stdout)
        assert seen_rank == rank and seen[1:] == [f"--local_rank={rank}", *TRICKY], ran
        assert seen[0] == {"script": "show.py", "module": str(tmp_path / "show.py"), "no_python": script}[how]


@pytest.mark.parametrize("local_rank_arg", [True, False])
def test_each_rank_log_takes_each_workers_output_to_its_own_file(tmp_path, local_rank_arg):
    """DeepSpeed's --enable_each_rank_log DIR: DIR/<launch time>_rank<RANK>.log per worker, stdout and stderr."""
    (tmp_path / "show.py").write_text(ARGV_SCRIPT + "import sys; sys.stderr.write('to stderr\\n')\n")
    folder = tmp_path / "rank logs"
    opts = LaunchOptions("show.py", ["a b"], local_rank_arg=local_rank_arg, each_rank_log=str(folder), log_prefix="T")
    argv = single_node(opts, nproc=2)
    worker = argv[argv.index("--no_python") + 1 :]
    for rank in ("0", "1"):
        env = {**os.environ, "LOCAL_RANK": rank, "RANK": str(int(rank) + 2)}
        ran = subprocess.run(worker, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert ran.returncode == 0 and ran.stdout == ran.stderr == "", ran
        first, second = (folder / f"T_rank{int(rank) + 2}.log").read_text().splitlines()
        given = [f"--local_rank={rank}"] if local_rank_arg else []
        assert json.loads(first) == [rank, ["show.py", *given, "a b"]] and second == "to stderr"
    (tmp_path / "a file").write_text("")
    assert main(["launch", "--enable_each_rank_log", str(tmp_path / "a file"), "show.py"]) == 2


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by the launcher: the other tests of this
# file
@pytest.mark.slow
def test_a_script_without_local_rank_is_told_about_no_local_rank(tmp_path):
    """A real two-worker launch: every worker gets its own --local_rank (each refuses its own); a script refusing it
    (argparse's exit 2) fails with a line saying how to leave it out (--no_local_rank:
    test_dry_run_single_node_and_module)."""
    strict = "import argparse\np = argparse.ArgumentParser()\np.add_argument('--x')\np.parse_args()\n"
    (tmp_path / "strict.py").write_text(strict)
    launch = [sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc_per_node", "2"]
    ran = subprocess.run([*launch, "strict.py", "--x", "1"], cwd=tmp_path, capture_output=True, text=True)
    assert ran.returncode == 2 and "unrecognized arguments: --local_rank=" in ran.stderr
    assert {f"--local_rank={r}" for r in "01"} <= set(ran.stderr.split()), ran.stderr
    assert ran.stderr.strip().splitlines()[-1].endswith("pass --no_local_rank to zeroshard launch)"), ran.stderr


def test_launch_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "hosts"
    bad.write_text("worker-0 slots=2\nworker-1\n")
    assert main(["launch", "--hostfile", str(bad), "--dry-run", "train.py"]) == 2  # bad input, as a bad option
    err = capsys.readouterr().err
    assert err.strip().endswith(f"hostfile {bad} line 2: expected 'HOST slots=N', got 'worker-1'")
    assert "Traceback" not in err


def test_slots_of_this_machine_count_the_gpus_it_was_given(monkeypatch):
    """With CUDA_VISIBLE_DEVICES=4,5,6,7 set, slots 1,2 are GPUs 5 and 6 (they were written as GPUs 1 and 2, outside
    the set; slots 0,1 inherited the whole set), as slot numbers count the GPUs this process sees."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    for slots, ids in (([1, 2], "5,6"), ([0, 1], "4,5")):
        (node,) = multi_node(LaunchOptions("train.py"), {"localhost": slots}, {})
        assert node.env["CUDA_VISIBLE_DEVICES"] == ids, node.env
    with pytest.raises(LaunchError, match=r"slot\(s\) \[4\].*CUDA_VISIBLE_DEVICES=4,5,6,7 gives this machine 4"):
        multi_node(LaunchOptions("train.py"), {"localhost": [0, 4]}, {})
    (remote,) = multi_node(LaunchOptions("train.py"), {"worker-1": [1, 3]}, {})  # another machine's own numbering
    assert remote.env["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_remote_nodes_get_the_allocator_settings_and_a_share_of_their_own_cores(tmp_path):
    """The local node inherits everything: a remote one gets PYTORCH_/CUDA_ settings too (not this machine's
    CUDA_VISIBLE_DEVICES), and without OMP_NUM_THREADS divides its own cores as a local launch does (torchrun: 1)."""
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_VISIBLE_DEVICES": "0", "HOME": "/h"}
    environ |= {"CUDA_HOME": "/usr/local/cuda-12", "CUDA_LAUNCH_BLOCKING": "1"}  # the toolkit's path is the node's own
    assert exported_environment(environ, str(tmp_path), str(tmp_path)) == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "CUDA_LAUNCH_BLOCKING": "1",
    }
    shares = []
    for exports in ({}, {"OMP_NUM_THREADS": "3"}):
        (node,) = multi_node(LaunchOptions("train.py"), {"worker-1": [0, 1, 2, 3]}, exports)
        shares.append("$(( $(nproc) / 4 ))" in node.shell_command("/w"))
    assert shares == [True, False]
    # the share is computed in the node's shell, and a failed cd still stops the command
    (node,) = multi_node(LaunchOptions("-c", module=False, no_python=True), {"localhost": [0, 1]}, {})
    local = node.shell_command(str(tmp_path)).replace(shlex.join(node.argv), "echo $OMP_NUM_THREADS")
    ran = subprocess.run(["bash", "-c", local], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert ran.returncode == 0 and int(ran.stdout) >= 1, ran
    gone = node.shell_command(str(tmp_path / "missing")).replace(shlex.join(node.argv), "echo ran")
    ran = subprocess.run(["bash", "-c", gone], capture_output=True, text=True)
    assert ran.returncode != 0 and "ran" not in ran.stdout, ran


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--master_port", "99999", "s.py"], "--master_port 99999 is not a TCP port (1-65535)"),
        (["--nnodes", "2", "--node_rank", "5", "--master_addr", "h", "s.py"], "--node_rank 5 must be in 0..1"),
        (["--nproc_per_node", "2", "nope.py"], "nope.py: no such script"),
        (["-m", "--no_python", "mod"], "-m/--module and --no_python cannot be used together"),
    ],
)
def test_what_no_rank_could_get_past_is_refused_before_starting(argv, message, capsys):
    """They started every rank before (a traceback from torchrun's port check; a wait with no output for a node rank
    that can never join; each rank failing on a missing script alone, the launcher naming rank 0 first)."""
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_busy_master_port_is_one_line_before_any_worker_starts(tmp_path, capsys):
    """torch's store failed to bind it after the workers had started: a 40-line DistNetworkError traceback."""
    import socket

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a worker started')\n")
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = main(["launch", "--nproc_per_node", "1", "--master_port", str(port), str(script)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"--master_port {port}: another process listens on it" in err, err


def test_a_filter_and_counts_together_are_refused_as_deepspeed_refuses_them(capsys):
    """`-i localhost:0 --num_gpus 2` ran (the counts applied after the filter); DeepSpeed refuses the pair."""
    for extra in (["--num_gpus", "1"], ["--num_nodes", "1"]):
        code = main(["launch", "-i", "localhost:0", *extra, "--dry-run", "train.py"])
        err = capsys.readouterr().err
        assert code == 2 and "--num_nodes/--num_gpus with --include/--exclude" in err, err


def test_job_hostfile_is_the_default_where_nothing_else_chose_the_nodes(tmp_path, monkeypatch, capsys):
    """DeepSpeed's `/job/hostfile` default; not with --nnodes/--node_rank/--master_addr, a scheduler or --cluster
    none, whose documented one-node launches it turned into ssh launches of every host."""
    import zeroshard.cli.launch as launch

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=1\nworker-1 slots=1\n")
    monkeypatch.setattr(launch, "DEFAULT_HOSTFILE", str(hostfile))
    assert main(["launch", "--dry-run", "train.py"]) == 0
    assert "worker-1" in capsys.readouterr().out  # every host of it
    for extra in (["--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1"], ["--cluster", "none"]):
        assert main(["launch", "--nproc_per_node", "1", *extra, "--dry-run", "train.py"]) == 0
        assert "worker-1" not in capsys.readouterr().out, extra
