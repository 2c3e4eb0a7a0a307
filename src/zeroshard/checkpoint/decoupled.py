"""Decoupled checkpoint writes (`checkpoint.writer.decoupled`): training goes on while a thread writes the files.

[Note: decoupled checkpoint writes]
DeepSpeed's decoupled checkpoint engine hands the state to a writer process and commits the checkpoint at the next
optimizer step, before the step changes what is being written. Here `save_checkpoint` runs the first phase of a
save (the ranks agree on the tag, the free space is checked), takes on the main thread what must be read at the call
(RNG state, scheduler, loss scaler, sampler, scalar optimizer state, the counters for metadata.json, copies of the
module's buffers, which a forward may change), lists this rank's files with views of its shards (no copies: no
extra memory) and returns; a thread of the rank writes and fsyncs them. The commit (rank 0 writes metadata.json,
renames the directory and replaces `latest`; every rank gets the outcome) runs on every rank's main thread at the
first of: the next optimizer step (`engine.step()` on a boundary, before the strategy changes anything), the next
`save_checkpoint` or `load_checkpoint`, `offload_states`, `destroy`, `engine.commit_checkpoint()`, or the end of the
process (atexit, unless it ends with an uncaught exception). Forward and backward overlap the writes. A crash
before the commit leaves `latest` at the previous checkpoint ([Note: crash safety] holds); an error of the writes is
raised by the commit, on every rank. On CUDA the thread copies on its own stream, after an event recorded at the
call.

Written before the call returns instead, with one log line: state swapped to NVMe (`offload_optimizer` or
`offload_param` device "nvme": the swap buffers belong to training) and pipeline engines (their stages save in
turns, [Note: pipeline checkpoints]). Anything else that changes the shards before the commit (a script writing
into parameters outside `engine.step()`) would be written half-changed: commit first (`engine.commit_checkpoint()`).
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zeroshard.checkpoint.save import SaveCall, finish_save
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def decoupled(engine: Any) -> bool:
    """Whether this engine's saves are decoupled: `checkpoint.writer.decoupled`, unless the state is swapped to NVMe
    or the engine saves in turns (a pipeline), which one log line per engine says."""
    writer = engine.config.checkpoint.writer
    if writer is None or not writer.decoupled:
        return False
    z = engine.config.zero_optimization
    swapped = ("offload_optimizer", "offload_param") if int(z.stage) == 3 else ("offload_optimizer",)
    nvme = [k for k in swapped if str(getattr(z, k).device) == "nvme"]
    why = f"{' and '.join(nvme)} on NVMe" if nvme else "a pipeline engine" if engine._saves_in_turns else None
    if why is None:
        return True
    if not getattr(engine, "_told_not_decoupled", False):
        engine._told_not_decoupled = True
        log_rank(logger, 20, f"checkpoint.writer.decoupled: saves are written before save_checkpoint returns ({why})")
    return False


class PendingSave:
    """A decoupled save between its call and its commit; the writer thread starts at once."""

    def __init__(self, call: SaveCall, device: torch.device):
        self.call = call
        self._after_commit: list[Callable[[], None]] = []
        self._ready = None
        if device.type == "cuda":  # what the call's views hold is complete once the current stream gets here
            self._ready = torch.cuda.Event()
            self._ready.record()
        self.device = device
        self.thread = threading.Thread(target=self._write, name=f"zeroshard-checkpoint-{call.tag}")
        self.thread.start()
        _PENDING.add(self)
        _hook_exit()

    def _write(self) -> None:
        with self._stream():
            self.call.write()

    @contextlib.contextmanager
    def _stream(self) -> Iterator[None]:
        if self._ready is None:
            yield
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_event(self._ready)
        with torch.cuda.stream(stream):
            yield

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the main thread once the checkpoint is committed (the HF Trainer's checkpoint rotation)."""
        self._after_commit.append(fn)

    def commit(self) -> bool:
        """Wait for this rank's writes, then commit on every rank (collective); raises what failed on any rank."""
        _PENDING.discard(self)
        self.thread.join()
        finish_save(self.call)
        for fn in self._after_commit:
            fn()
        return True


_PENDING: set[PendingSave] = set()  # strong: a script may drop its engine before the end


def _failing() -> bool:
    """Whether the process is ending with an error: an uncaught exception (`sys.last_value`), or a multiprocessing
    worker whose target raised (its exit hooks run while the exception propagates; a non-zero `sys.exit` too)."""
    error = sys.exc_info()[1]
    if isinstance(error, SystemExit):
        return error.code not in (None, 0)
    return error is not None or getattr(sys, "last_value", None) is not None


def _commit_at_exit() -> None:
    """A script that saves and ends: its last decoupled save is committed, not lost ([Note: decoupled checkpoint
    writes]). Not when the process ends with an error: the other ranks may be in a collective and never commit."""
    for pending in list(_PENDING):
        if _failing():
            _PENDING.discard(pending)
            logger.warning(
                f"the decoupled checkpoint {pending.call.tag} was not committed: the process ends with an error "
                "(latest still names the previous checkpoint)"
            )
            continue
        try:
            pending.commit()
        except Exception as e:  # noqa: BLE001 - at exit: say it, nothing else can
            logger.error(f"the decoupled checkpoint {pending.call.tag} could not be committed at exit: {e}")


_HOOKED: set[int] = set()  # the processes that registered the exit hook


def _hook_exit() -> None:
    """Register `_commit_at_exit` once per process, through multiprocessing's exit hooks: they run at interpreter
    exit (atexit) and also when a multiprocessing worker (`mp.spawn`, `Process`) returns, where atexit does not."""
    if os.getpid() in _HOOKED:
        return
    _HOOKED.add(os.getpid())
    multiprocessing.util.Finalize(None, _commit_at_exit, exitpriority=100)
