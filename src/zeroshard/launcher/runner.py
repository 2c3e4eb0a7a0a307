"""Start the planned node commands and wait: one local torchrun, or one per host over ssh."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping

from zeroshard.launcher.plan import NodeCommand
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


def run_local(argv: list[str], nproc: int) -> int:
    """Run torchrun here in the foreground; its exit code is ours (Ctrl-C reaches it through the terminal)."""
    return subprocess.call(argv, env={**os.environ, **thread_env(nproc, os.environ)})


def thread_env(nproc: int, environ: Mapping[str, str]) -> dict[str, str]:
    """OMP_NUM_THREADS = this machine's cores / processes, unless set (torchrun would pick 1 and warn)."""
    if "OMP_NUM_THREADS" in environ or nproc <= 1:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cores // nproc))}


def run_nodes(nodes: list[NodeCommand], cwd: str, poll_s: float = 0.5) -> int:
    """Start every node, wait for all; when one fails, stop the others and return its exit code."""
    procs = [(node, subprocess.Popen(node.full_argv(cwd), start_new_session=True)) for node in nodes]
    failed = 0
    try:
        while any(p.poll() is None for _, p in procs):
            for node, p in procs:
                code = p.poll()
                if code not in (None, 0) and not failed:
                    failed = code
                    logger.error(
                        "node %d (%s) exited with %d; stopping the other nodes", node.node_rank, node.host, code
                    )
                    _terminate(procs)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _terminate(procs)
        raise
    codes = [p.returncode for _, p in procs]
    return failed or next((c for c in codes if c), 0)


def _terminate(procs: list[tuple[NodeCommand, subprocess.Popen[bytes]]]) -> None:
    for _, p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
