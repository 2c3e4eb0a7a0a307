"""Tensors a collective may still hold, drained before the interpreter finalizes.

[Note: nothing held by a collective at exit]
A backend's worker thread (gloo's `runLoop`, NCCL's watchdog) keeps the work object of a collective, and with it
the tensors it was handed, until slightly after the work completes: `wait()` returns on the caller's thread while
the worker has yet to drop its reference. Since torch's PyObject preservation (2.10), dropping the reference that
takes a tensor with a Python wrapper from two owners to one releases the wrapper, which takes the GIL. If the main
thread has begun finalizing the interpreter by then, `take_gil` ends the worker thread with `pthread_exit`, the
forced unwind meets a `noexcept` destructor, and the process dies in `std::terminate` ("terminate called without
an active exception", SIGABRT) after the script itself succeeded. Measured: `cifar10_deepspeed.py --stage 3` on 2
gloo ranks aborted in 2-4 runs of 20 this way (core dump: `~AsyncBroadcastWork` -> `TensorImpl::decref_pyobject`
-> `gil_scoped_acquire` in a gloo worker while `Py_FinalizeEx` collected garbage), usually after the last step's
gather of the persistent parameters. Known upstream (pytorch/pytorch#190489; an atexit `destroy_process_group`,
#179291, was abandoned): no torch release avoids it.

Only a tensor that nothing but its Python wrapper held when it was handed over can take that path (otherwise the
worker's drop leaves two owners and touches no wrapper), so `issue` keeps weak references to those (chunk views made
for the call, scratch buffers, small tensors built for one all-reduce) and to the call's work objects. At exit,
`drain` waits (without the GIL, so a worker that needs it gets it) for every entry:
- while Python still holds an entry's works (a pending prefetch's handle), until they complete: the worker's drop is
  then not the last one, and Python's own, on the main thread, is harmless;
- once Python let them go (a synchronous collective, a dropped handle), until each tensor is dead or its only owner
  is its wrapper again, i.e. the worker has let go.
Pending collectives finish first, as every rank drains. The wait is bounded (a peer that died leaves its collectives
pending) and costs nothing when nothing is held. The engine's collectives are followed (`Collectives.in_flight`, FSDP2's
custom collectives included), and a script's own through `zeroshard.comm` (`USER_IN_FLIGHT` in comm/api.py).

That covers collectives still pending at exit, not the moment after one completes. A worker drops its work a little
after completing it (gloo's `runLoop` at the end of its loop, under the queue's lock), and every tensor the work held
can take the path above, followed or not: one that other owners held at the call (a flat buffer that gradient views
share, a pipeline stage's activations sent by torch's schedules, a direct `torch.distributed` call) becomes one whose
last owners are the worker and the wrapper once the interpreter frees those others as it finalizes, which it does
since engines dropped without `destroy()` are collected ([Note: tensor hooks hold their owner weakly]). Nothing in
Python tells when a worker has let go, but the kernel tells whether it runs: a worker between completing a work and
dropping it is running or runnable (state R in /proc/self/task/*/stat), or waits for the GIL, which each sleep of
the polling thread hands it (a waiter woken by that is runnable again). So after draining, while a process group is
initialized, `quiesce` waits until no other thread of the process is runnable at three polls in a row, 2 ms apart
with the GIL released, bounded by a second (a thread of the script's that never rests costs that second); about 7 ms
when the workers are idle. Measured on 2 gloo ranks of the 2-core CPU machine with a busy process beside them,
DeepSpeedExamples' pipeline script (tests/compat/scripts/pipeline_train.py, which ends with its own
`dist.broadcast`) aborted at exit in 4 of 200 runs before (core dump: `~AsyncBroadcastWork` in gloo's `runLoop`
-> `decref_pyobject` -> `take_gil` -> `pthread_exit`, the main thread in `Py_FinalizeEx`'s garbage collection), 0
of 200 after.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

DRAIN_TIMEOUT_S = 10.0
QUIESCE_TIMEOUT_S = 1.0
_POLL_S = 0.001
_QUIET_POLLS = 3
_QUIET_POLL_S = 0.002
_R = TypeVar("_R")


@dataclass
class _Entry:
    tensors: list[weakref.ref[torch.Tensor]]
    works: list[weakref.ref[Any]]

    def settled(self) -> bool:
        works = [w for ref in self.works if (w := ref()) is not None]
        if works:
            return all(w.is_completed() for w in works)
        return all((t := ref()) is None or _owners(t) == 1 for ref in self.tensors)


class InFlight:
    """Recent collectives' sole-owned tensors and works, weakly; `drain` runs at exit for every one still alive."""

    def __init__(self, capacity: int = 256) -> None:
        # older entries belong to collectives that completed long ago: a bounded window is enough
        self._entries: deque[_Entry] = deque(maxlen=capacity)
        _ALIVE.add(self)  # weakly: a Collectives made per call (a user's sequence-parallel group) leaves nothing

    def issue(self, tensors: Iterable[torch.Tensor], call: Callable[[], _R]) -> _R:
        """`call()`, the collective handed `tensors`, followed to exit: those only their Python wrapper owned before
        the call, and what it returns when that is a work (or a list of works) Python may keep."""
        sole = [t for t in tensors if _owners(t) == 1]
        result = call()
        if sole:
            works = result if isinstance(result, list) else [result] if hasattr(result, "is_completed") else []
            self._entries.append(_Entry([weakref.ref(t) for t in sole], [weakref.ref(w) for w in works]))
        return result

    def held(self) -> int:
        """How many tracked collectives a backend may still drop a wrapped tensor of."""
        return sum(1 for entry in self._entries if not entry.settled())

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
        """Wait until every tracked collective is settled (True), or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self.held():
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)  # releases the GIL: a worker dropping its work may need it
        self._entries.clear()
        return True


# the exit hook's followers: one hook for the process, each InFlight only while something else holds it
_ALIVE: weakref.WeakSet[InFlight] = weakref.WeakSet()


@atexit.register
def _at_exit() -> None:
    for in_flight in list(_ALIVE):
        in_flight.drain()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        quiesce()


def quiesce(timeout_s: float = QUIESCE_TIMEOUT_S) -> bool:
    """Wait until no thread of this process but the caller is runnable at `_QUIET_POLLS` polls in a row, the GIL
    released between them (True), or `timeout_s` passed (False). True at once where /proc cannot tell."""
    own, quiet = threading.get_native_id(), 0
    deadline = time.monotonic() + timeout_s
    while quiet < _QUIET_POLLS:
        time.sleep(_QUIET_POLL_S)  # a thread waiting for the GIL gets it now
        runnable = _runnable_threads(own)
        if runnable is None:
            return True
        quiet = quiet + 1 if runnable == 0 else 0
        if quiet < _QUIET_POLLS and time.monotonic() > deadline:
            return False
    return True


def _runnable_threads(own: int) -> int | None:
    """How many of this process's threads other than `own` are running or runnable; None without /proc."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    runnable = 0
    for tid in tids:
        if int(tid) == own:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the thread has ended
        state_at = stat.rindex(b")") + 2  # the name, in parentheses, may hold spaces
        runnable += stat[state_at : state_at + 1] == b"R"
    return runnable


def _owners(tensor: torch.Tensor) -> int:
    """C++ owners of `tensor`'s TensorImpl (its Python wrapper is one); 1 where torch cannot say."""
    use_count = getattr(tensor, "_use_count", None)
    return int(use_count()) if use_count is not None else 1
