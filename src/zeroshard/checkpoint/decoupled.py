"""Decoupled checkpoint writes (`checkpoint.writer.decoupled`): training goes on while a thread writes the files.

[Note: decoupled checkpoint writes]
DeepSpeed's decoupled checkpoint engine hands the state to a writer process and commits the checkpoint at the next
optimizer step, before the step changes what is being written. Here `save_checkpoint` runs the first phase of a
save (the ranks agree on the tag, the free space is checked), takes on the main thread what must be read at the call
(RNG state, scheduler, loss scaler, sampler, scalar optimizer state, the counters for metadata.json, copies of the
module's buffers, which a forward may change), lists this rank's files with views of its shards (no copies of the
model states; stage 3's packed units excepted) and returns; a thread of the rank writes and fsyncs them. On CUDA
the thread copies on the engine's own stream, after an event recorded on the device's current stream at the call.

The commit (rank 0 writes metadata.json, renames the directory and replaces `latest`; every rank gets the outcome)
runs on every rank's main thread at the first of: the next optimizer step (`engine.step()` on a boundary, before the
strategy changes anything; before the boundary's backward when the strategy steps during it, super_offload), the
next `save_checkpoint` or `load_checkpoint`, `offload_states`, `destroy`, `engine.commit_checkpoint()`, or the end of
the process (multiprocessing's exit hooks: atexit, and a multiprocessing worker's return). The ranks first meet as a
checkpoint call of their own (`commit_checkpoint`), so a commit reached on some ranks only is named by the watch
within seconds ([Note: one-rank checkpoint calls]). A rank that is failing gives the save up instead (`abandon`:
its absence and its phase-2 error are posted without waiting), so the others' commit raises at once; `latest`
keeps naming the checkpoint before. What changes state outside the step (`safe_set_full_*`, a modifier rank's
GatheredParameters, super_offload's host steps under a `loss.backward()` not made through the engine) first waits
for this process's writer threads (`wait_for_writes`, not collective). Forward and
backward overlap the writes. A crash before the commit leaves `latest` at the previous checkpoint ([Note: crash
safety] holds); an error of the writes is raised by the commit, on every rank.

Written before the call returns instead, with one log line: state swapped to NVMe (`offload_optimizer` or
`offload_param` device "nvme": the swap buffers belong to training), pipeline engines (the call ends with every
stage's save and an all-reduce naming the stages that failed, [Note: pipeline checkpoints]), and a save while
`offload_states()` holds states (they move out again after the writes: [Note: offloaded states]).
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing.util
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.save import SaveCall, finish_save
from zeroshard.checkpoint.sync import ENTRY_PHASE, RankSync, phase_key, write_timeout
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def decoupled(engine: Any) -> bool:
    """Whether this engine's saves are decoupled: `checkpoint.writer.decoupled`, unless the state is swapped to NVMe
    or the engine saves per pipeline stage, which one log line per engine says."""
    writer = engine.config.checkpoint.writer
    if writer is None or not writer.decoupled:
        return False
    z = engine.config.zero_optimization
    swapped = ("offload_optimizer", "offload_param") if int(z.stage) == 3 else ("offload_optimizer",)
    nvme = [k for k in swapped if str(getattr(z, k).device) == "nvme"]
    why = f"{' and '.join(nvme)} on NVMe" if nvme else "a pipeline engine" if engine._saves_per_stage else None
    if why is None:
        return True
    if not getattr(engine, "_told_not_decoupled", False):
        engine._told_not_decoupled = True
        log_rank(logger, 20, f"checkpoint.writer.decoupled: saves are written before save_checkpoint returns ({why})")
    return False


COMMIT = "commit_checkpoint"  # the store keys of every commit, whatever call reached it (messages name the call)


class PendingSave:
    """A decoupled save between its call and its commit; the writer thread starts at once. `stream`: the engine's
    own CUDA stream for the thread's copies (None on the CPU)."""

    def __init__(self, call: SaveCall, stream: torch.cuda.Stream | None = None):
        self.call = call
        self.pid = os.getpid()  # a forked child inherits the list, not the save
        self.during = sys.exc_info()[1]  # an exception being handled at the call (an emergency save)
        self._after_commit: list[Callable[[], None]] = []
        self._stream = stream
        self._ready = None
        if stream is not None:  # what the call's views hold is complete once the device's current stream gets here
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(stream.device))
        # a daemon: a failing process gives the save up at once instead of first waiting for its writes
        self.thread = threading.Thread(target=self._write, name=f"zeroshard-checkpoint-{call.tag}", daemon=True)
        self.thread.start()
        _PENDING.append(self)
        _hook_exit()

    def _write(self) -> None:
        with self._on_stream():
            self.call.write()

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self._stream is None or self._ready is None:
            yield
            return
        # a new thread starts on device 0: on the stream's own device, leaving the block makes no context on device 0
        torch.cuda.set_device(self._stream.device)
        self._stream.wait_event(self._ready)
        with torch.cuda.stream(self._stream):
            yield

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the main thread once the checkpoint is committed (the HF Trainer's checkpoint rotation)."""
        self._after_commit.append(fn)

    def commit(self, op: str = COMMIT) -> bool:
        """Wait for this rank's writes, then commit on every rank (collective); raises what failed on any rank.
        The ranks first meet as a checkpoint call of their own: a rank that commits alone (a save or load on some
        ranks only) is named in seconds, as for any checkpoint call ([Note: one-rank checkpoint calls]); `op` is the
        call that reached the commit, for the messages."""
        _forget(self)
        call, sync = self.call, self.call.sync
        meeting = RankSync(COMMIT, sync.rank, sync.world_size, sync.store)
        try:
            saves = meeting.all_gather(ENTRY_PHASE, {"tag": call.tag, "nonce": call.nonce}, write_timeout())
            if len({s["nonce"] for s in saves}) > 1:
                tags = [s["tag"] for s in saves]
                raise CheckpointError(f"the ranks commit different decoupled saves {tags}; they went out of step")
        except Exception as e:
            _give_up_entry(meeting, f"its commit failed: {e}", overwrite=True)  # a rank arriving later fails at once
            self.thread.join()
            if call.commits:
                shutil.rmtree(call.tmp_dir, ignore_errors=True)
            reason = str(e).removeprefix(f"{COMMIT}: ")
            raise CheckpointError(f"{op}: the decoupled save {call.tag} was not committed: {reason}") from e
        self.thread.join()
        finish_save(call)
        failed: BaseException | None = None
        for fn in self._after_commit:  # each runs, whatever an earlier one raised; the first error is raised
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - raised below, after the others ran
                failed = failed or e
        if failed is not None:
            raise failed
        return True

    def abandon(self, why: str) -> None:
        """Give the save up without waiting for the other ranks' writes (this rank is failing): their commit raises
        `why` at once instead of waiting for this rank; `latest` is unchanged. Never raises (the store may be gone
        with the rank that failed first)."""
        _forget(self)
        sync = self.call.sync
        try:
            _give_up_entry(RankSync(COMMIT, sync.rank, sync.world_size, sync.store, announce=False), why)
        except Exception as e:  # noqa: BLE001 - failing already: say it, do not replace the error
            logger.warning(f"could not tell the other ranks that this rank gives its save up: {e}")
        logger.warning(f"the decoupled checkpoint {self.call.tag} was not committed: {why}")


def _give_up_entry(meeting: RankSync, why: str, overwrite: bool = False) -> None:
    """This rank's entry of the commit call says it failed; rank 0, which usually hosts the store, waits a little
    for the others to come and read it before it goes."""
    meeting.abandon(why, overwrite)
    store = meeting.store
    if store is None or meeting.world_size == 1 or meeting.rank != 0:
        return
    others = [phase_key(meeting.call, meeting.op, ENTRY_PHASE, r) for r in range(1, meeting.world_size)]
    with contextlib.suppress(Exception):
        store.wait(others, datetime.timedelta(seconds=GIVE_UP_LINGER_S))
        time.sleep(0.5)


GIVE_UP_LINGER_S = 5.0
_PENDING: list[PendingSave] = []  # in the order of the calls (the same on every rank); strong references


def _forget(pending: PendingSave) -> None:
    if pending in _PENDING:
        _PENDING.remove(pending)


def _mine() -> list[PendingSave]:
    return [p for p in _PENDING if p.pid == os.getpid()]


def wait_for_writes() -> None:
    """Wait for this process's writer threads (not collective): what writes state outside `engine.step()`
    (safe_set_full_*, a modifier rank's GatheredParameters) calls it, so no file gets a half-changed tensor."""
    for pending in _mine():
        pending.thread.join()


def abandon_all(why: str) -> None:
    """Give up every pending save of this process (it is failing; `zeroshard train` calls it on an error)."""
    for pending in _mine():
        pending.abandon(why)


def failing(during: BaseException | None = None) -> bool:
    """Whether the process is failing: an uncaught exception (`sys.last_value`), an exception being handled other
    than `during` (the one a save was made under), or in a multiprocessing worker a target that raised (its exit
    hooks run while the exception propagates; a non-zero `sys.exit` too)."""
    error = sys.exc_info()[1]
    if isinstance(error, SystemExit):
        return error.code not in (None, 0)
    if error is not None and error is not during:
        return True
    return getattr(sys, "last_value", None) is not None


def _commit_at_exit() -> None:
    """A script that saves and ends: its last decoupled save is committed, not lost ([Note: decoupled checkpoint
    writes]). When the process ends with an error, the save is given up and the others told at once (with one
    process, where no other rank can wait, it is committed all the same)."""
    for pending in _mine():
        if failing() and pending.call.sync.world_size > 1:
            pending.abandon("the process ended with an error before the commit")
            continue
        try:
            pending.commit("exit")
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
