"""`zeroshard launch` on torchrun: a crashed rank restarts the group (--max_restarts), and the restarted
ranks build their process group on a fresh per-attempt store (`rendezvous.init_process_group_from_env`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    from zeroshard.launcher.rendezvous import init_process_group_from_env, restart_count

    init_process_group_from_env("gloo", timeout_s=60)
    total = torch.ones(1)
    dist.all_reduce(total)
    if restart_count() == 0 and dist.get_rank() == 1:
        sys.exit(3)  # a crash in the first attempt; rank 0 waits in the barrier until it is stopped
    dist.barrier()
    if dist.get_rank() == 0:
        with open(sys.argv[-1], "w") as handle:  # (after the --local_rank=N zeroshard launch passes)
            handle.write(f"{restart_count()} {int(total.item())} {dist.get_world_size()}")
    dist.destroy_process_group()
    """
)


@pytest.mark.slow  # default-suite budget: moved 2026-11-25 (seventeenth session)
def test_launch_restarts_a_crashed_group(tmp_path):
    script, result = tmp_path / "crash_once.py", tmp_path / "result.txt"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    command = [sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc_per_node", "2", "--max_restarts", "1"]
    done = subprocess.run([*command, str(script), str(result)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert result.read_text() == "1 2 2"  # second attempt, both ranks in the all-reduce


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by failure reports:
# tests/unit/test_cli_failures.py
@pytest.mark.slow
def test_launch_reports_failed_ranks_without_a_traceback(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(5)\n")
    command = [sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc_per_node", "2", str(script)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 5
    assert re.search(r"rank [01] \(local rank [01], pid \d+\) failed first, exit code 5", done.stderr), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "sig", [pytest.param(s, marks=pytest.mark.slow) for s in ("SIGINT", "SIGTERM")]
)  # CI budget: the default suite in 15 minutes on 2 AVX2 cores
def test_a_signal_to_the_launcher_alone_stops_its_workers(tmp_path, sig):
    """[Note: stopping a local run]: `kill` of the launcher (a scheduler, `timeout`), not a terminal's Ctrl-C of the
    whole group, left the workers running with the launcher gone."""
    import signal
    import time

    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\nopen(sys.argv[-1] + str(os.getpid()), 'w').close()\ntime.sleep(120)\n")
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    command = [sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc_per_node", "2", str(script)]
    launcher = subprocess.Popen([*command, str(tmp_path / "pid.")], env=env, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = [int(p.name.split(".")[1]) for p in tmp_path.glob("pid.*")]
    assert len(workers) == 2, "the workers did not start"
    launcher.send_signal(getattr(signal, sig))
    assert launcher.wait(timeout=40) == 130
    for pid in workers:  # reaped by torchrun before it exited
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} outlived the launcher"


@pytest.mark.slow  # (two launchers rendezvous, ~8 s: CI budget)
def test_a_sigterm_to_a_nodes_launcher_stops_its_workers(tmp_path):
    """The same for one node of a multi-node job started without a hostfile (`--nnodes 2 --node_rank I
    --master_addr A`, as a scheduler starts one launcher per node): a SIGTERM ended the launcher alone and left its
    torchrun and workers running."""
    import signal
    import time

    from helpers.harness import _free_port

    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\nopen(sys.argv[-1] + str(os.getpid()), 'w').close()\ntime.sleep(120)\n")
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    port = str(_free_port())
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "zeroshard.cli.main", "launch", "--nnodes", "2", "--node_rank", str(rank)]
            + ["--master_addr", "127.0.0.1", "--master_port", port, "--nproc_per_node", "1", "--no_local_rank"]
            + [str(script), str(tmp_path / f"pid{rank}.")],
            env=env,
            cwd=tmp_path,
        )
        for rank in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("pid*.*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = {p.name.split(".")[0]: int(p.name.split(".")[1]) for p in tmp_path.glob("pid*.*")}
        assert len(workers) == 2, "the workers did not start"
        nodes[1].send_signal(signal.SIGTERM)
        assert nodes[1].wait(timeout=40) == 130
        assert not os.path.exists(f"/proc/{workers['pid1']}"), "node 1's worker outlived its launcher"
    finally:
        for node in nodes:
            node.send_signal(signal.SIGTERM)
            node.wait(timeout=60)
