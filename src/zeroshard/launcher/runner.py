"""Start the planned node commands and wait: one local torchrun, one per host over ssh, or this node's
torchrun of a scheduler's multi-node job while a NodeWatch follows the other nodes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from zeroshard.launcher.node_watch import NodeWatch
from zeroshard.launcher.plan import NodeCommand
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


class _Terminated(Exception):
    """This process got SIGTERM while it waited for torchrun."""


def run_local(argv: list[str], nproc: int, grace_s: float = 30.0) -> int:
    """Run torchrun here and wait; its exit code is ours.

    [Note: stopping a local run]
    torchrun runs in a session of its own, and an interrupt or a SIGTERM of this process is passed on to torchrun's
    whole group (torchrun and its workers) once: a terminal's Ctrl-C and a signal sent to this process alone (`kill`,
    a scheduler, `timeout`) then stop the run alike. (With torchrun in the terminal's group, a signal to this process
    alone left the workers training, and this process killed torchrun before it could stop them.) After `grace_s`
    what is left is killed."""
    proc = subprocess.Popen(argv, env={**os.environ, **thread_env(nproc, os.environ)}, start_new_session=True)
    with passing_stops_on(proc, grace_s):
        return proc.wait()


def passing_stops_on(proc: subprocess.Popen[Any], grace_s: float) -> contextlib.AbstractContextManager[None]:
    """While inside, an interrupt or a SIGTERM of this process stops `proc`'s group (a session of its own) with the
    same signal ([Note: stopping a local run]) and comes out as KeyboardInterrupt."""
    return passing_stops(lambda sig: stop_group(proc, grace_s, sig))


@contextlib.contextmanager
def passing_stops(stop: Callable[[signal.Signals], None]) -> Iterator[None]:
    """While inside, an interrupt or a SIGTERM of this process calls `stop(signal)` and comes out as
    KeyboardInterrupt."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main else None
    try:
        yield
    except (KeyboardInterrupt, _Terminated) as stopped:
        stop(signal.SIGINT if isinstance(stopped, KeyboardInterrupt) else signal.SIGTERM)
        raise KeyboardInterrupt from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


def thread_env(nproc: int, environ: Mapping[str, str]) -> dict[str, str]:
    """OMP_NUM_THREADS = this machine's cores / processes, unless set (torchrun would pick 1 and warn)."""
    if "OMP_NUM_THREADS" in environ or nproc <= 1:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cores // nproc))}


def run_nodes(nodes: list[NodeCommand], cwd: str, poll_s: float = 0.5) -> int:
    """Start every node, wait for all; when one fails, stop the others and return its exit code.

    Each node's command (ssh, or bash for this host) reads from a pipe this process holds open and never writes: when
    it ends (stopped here, or this process killed) the node's torchrun sees its input close and stops its workers
    ([Note: stopping remote nodes])."""
    procs = [
        (node, subprocess.Popen(node.full_argv(cwd, watch_input=True), start_new_session=True, stdin=subprocess.PIPE))
        for node in nodes
    ]
    failed = 0
    with passing_stops(lambda sig: _terminate(procs, sig)):
        while any(p.poll() is None for _, p in procs):
            for node, p in procs:
                code = p.poll()
                if code not in (None, 0) and not failed:
                    failed = code
                    logger.error(
                        "node %d (%s) exited with %d; stopping the other nodes", node.node_rank, node.host, code
                    )
                    _terminate(procs, signal.SIGTERM)
            time.sleep(poll_s)
    codes = [p.returncode for _, p in procs]
    return failed or next((c for c in codes if c), 0)


def _terminate(procs: list[tuple[NodeCommand, subprocess.Popen[bytes]]], sig: signal.Signals) -> None:
    """`sig` to every node still running: the local one's group, a remote one's ssh (its input closes with it)."""
    for _, p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        if p.stdin is not None:
            p.stdin.close()


def run_watched(argv: list[str], nproc: int, watch: NodeWatch, max_restarts: int, poll_s: float = 0.5) -> int:
    """Run this node's torchrun while `watch` follows the other nodes ([Note: naming a lost node])."""
    # a fresh worker store per rendezvous round: see [Note: one store namespace per restart attempt]
    env = {**os.environ, **thread_env(nproc, os.environ), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    code: int | None = None
    try:
        # an interrupt or a SIGTERM (a scheduler, `timeout`) stops torchrun's group: [Note: stopping a local run]
        # (a SIGTERM ended this process alone before, and torchrun, in a session of its own, waited on)
        with passing_stops_on(proc, grace_s=10.0):
            while (code := proc.poll()) is None:
                lost = watch.lost()
                if lost is not None and max_restarts == 0:
                    logger.error(f"zeroshard launch: lost {lost}; stopping this node's workers")
                    stop_group(proc)
                    code = 1
                    break
                if lost is not None:
                    logger.warning(f"zeroshard launch: lost {lost}; torchrun restarts the group when it rejoins")
                    watch.forget()
                time.sleep(poll_s)
            else:
                if code != 0 and (lost := watch.wait_verdict(watch.lost_after_s + 5)) is not None:
                    logger.error(f"zeroshard launch: lost {lost}; this node's workers failed with it")
    finally:
        watch.stop(1 if code is None else code)
    return code


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 10.0, sig: signal.Signals = signal.SIGTERM) -> None:
    """`sig` to torchrun's process group (torchrun and its workers), SIGKILL what is left after `grace_s` (or at a
    second interrupt while it waits)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.communicate(timeout=grace_s)  # reading its pipes, if it has them: a full pipe would stall it
    except (subprocess.TimeoutExpired, KeyboardInterrupt, _Terminated):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:  # it was gone already
        proc.wait()
