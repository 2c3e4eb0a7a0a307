"""Starting torchrun process groups from the benchmark driver, and killing the whole group on timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def torchrun(module: str, world_size: int, args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world_size),
        "-m",
        module,
        *args,
    ]


def env(threads: int) -> dict[str, str]:
    """The driver's environment, with this checkout importable and `threads` OpenMP threads per rank."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), out.get("PYTHONPATH", "")) if p)
    out["OMP_NUM_THREADS"] = str(threads)
    out.setdefault("ZEROSHARD_LOG_LEVEL", "WARNING")
    return out


def run(cmd: list[str], log_path: Path, threads: int, timeout: float) -> int | None:
    """Run `cmd` in its own session with output to `log_path`; its exit code, or None if it was killed
    after `timeout` seconds (the whole process group: torchrun and every rank)."""
    environment = env(threads)
    environment["BENCH_LAUNCH_TIME"] = repr(time.time())
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def last_error(log_path: Path) -> str:
    """The last line of a log that mentions an error (else its last line), for a one-line note."""
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1][:300]
