"""A rank that skips a checkpoint call the others made (`if rank == 0: engine.save_checkpoint(...)`): named in
seconds on every rank, instead of after the entry timeout.

[Note: one-rank checkpoint calls]
A rank that does not call `save_checkpoint` while the others do goes on training, and its next collective
waits for ranks that are busy saving: neither side can finish. Telling that apart from a rank that is merely
late would cost a store write per step if every rank posted what it does, so it is kept in memory: `Activity`
records which engine call (forward, backward, step) the main thread is in, a few attribute writes per call
(about 3 us). A daemon thread per engine (`AbsenceWatch`) reads that record twice a second and touches the
store only while one engine call has lasted `CHECK_AFTER_S` (a training call that long is where a rank waits
for ranks that are elsewhere): every `CHECK_AFTER_S` it asks, in two small requests on its own connection,
whether a checkpoint call this rank has not made is open. If the same engine call is still running
`ZEROSHARD_CHECKPOINT_GRACE` seconds (default 5) after it saw one, the thread posts what the rank is doing as
the rank's arrival at the call (`{"absent": ...}`): the waiting ranks' store wait ends at once and they raise a
`CheckpointError` naming it. This rank's own collective then fails when they exit (gloo: at once; NCCL: the
launcher stops it, or the collective deadline) and the engine raises the same named error instead of the
backend's. The price is a false alarm for a rank that really is still inside one engine call more than the
grace after the others entered the call (local work after its last collective): it fails at once when it
arrives, saying so and naming the variable to raise. Ranks blocked outside engine calls (the script's own
collectives) are not seen: the entry timeout still names them. A pipeline engine's checkpoint calls begin with a
rendezvous over the whole world under a prefix of their own (each stage's keys are under another): its watch reads
that prefix (`_checkpoint_prefix`), so a save or load on one rank of a pipeline is named in seconds too.
"""

from __future__ import annotations

import json
import threading
import time
from types import TracebackType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.sync import ENTRY_PHASE, call_counter_key, default_store, grace_s, open_key, phase_key
from zeroshard.comm.topology import Topology
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

CHECK_AFTER_S = 2.0  # an engine call shorter than this is never a reason to ask the store
POLL_S = 0.5
REPORT_WAIT_S = 10.0  # how long a failed collective waits for the watch to finish posting this rank's absence


class EngineCall(NamedTuple):
    """One engine call in progress on the main thread (a tuple: built on every call, so kept cheap)."""

    what: str
    step: int
    seq: int
    since: float


class Activity:
    """What this rank's main thread is doing, in memory only; `verdict` is set when the watch found the rank
    absent from a checkpoint call the others made."""

    def __init__(self) -> None:
        self.current: EngineCall | None = None
        self.verdict: str | None = None
        # set while the watch posts this rank's absence: the others may give up, and this rank's collective fail,
        # before `verdict` is written; the main thread then waits for `reported`
        self.reporting = False
        self.reported = threading.Event()
        self._seq = 0

    def call(self, what: str, step: int) -> InsideCall:
        """`with activity.call("engine.backward", step):` records the call for the watch; a RuntimeError out of
        it (the collective that failed once the other ranks gave up) becomes the named `CheckpointError`
        when the watch found this rank absent."""
        return InsideCall(self, what, step)


class InsideCall:
    """The context manager `Activity.call` returns (a class, not a generator: it runs on every engine call)."""

    __slots__ = ("_activity", "_outer", "_step", "_what")

    def __init__(self, activity: Activity, what: str, step: int):
        self._activity, self._what, self._step = activity, what, step
        self._outer: EngineCall | None = None

    def __enter__(self) -> None:
        activity = self._activity
        self._outer = activity.current
        activity._seq += 1
        activity.current = EngineCall(self._what, self._step, activity._seq, time.monotonic())

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        activity = self._activity
        activity.current = self._outer
        if not isinstance(error, RuntimeError) or isinstance(error, CheckpointError):
            return
        if activity.reporting:
            activity.reported.wait(REPORT_WAIT_S)
        if activity.verdict is not None:
            raise CheckpointError(activity.verdict) from error


class AbsenceWatch:
    """The daemon thread of [Note: one-rank checkpoint calls]; `start` returns None where there is nothing to
    watch (one rank) or no store it can open a second connection to."""

    def __init__(self, activity: Activity, rank: int, world_size: int, store: dist.Store):
        self.activity = activity
        self.rank = rank
        self.world_size = world_size
        self._store = store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"zeroshard-checkpoint-watch-{rank}", daemon=True)

    @classmethod
    def start(cls, activity: Activity, topology: Topology, prefix: str = "") -> AbsenceWatch | None:
        """Collective over the default group: every rank opens its connection, then they agree (one MAX all-reduce)
        that all of them watch, or none does. `prefix`: where the engine's checkpoint calls keep their keys (a
        pipeline's calls over the whole world). The agreement is also what keeps a rank from going on before its peers
        are connected: rank 0 serves the store, and a rank 0 that finished and exited while a peer was still opening
        its connection left that peer retrying a dead address for the store's timeout (300 s, then again)."""
        rank, world_size = topology.rank, topology.world_size
        store = default_store() if world_size > 1 else None
        if store is None:
            return None
        try:
            own = store.clone()  # type: ignore[attr-defined]  # torch >= 2.4; the main connection may be busy
        except Exception:  # noqa: BLE001 - a store that cannot (FileStore, HashStore): the entry timeout remains
            own = None
        missing = torch.tensor([1.0 if own is None else 0.0], device=topology.device)
        dist.all_reduce(missing, op=dist.ReduceOp.MAX)
        if own is None or missing.item() > 0:
            return None
        watch = cls(activity, rank, world_size, dist.PrefixStore(prefix, own) if prefix else own)
        watch._thread.start()
        return watch

    def stop(self) -> None:
        """Also at interpreter exit (the engine's finalizer): the thread is joined, so it is never inside a store
        call while the process tears its connections down (a C++ exception there aborts the process)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=POLL_S + 5.0)

    def _run(self) -> None:
        seen: tuple[int, int, float] | None = None  # (engine call seq, checkpoint call, when first seen)
        asked = 0.0
        while not self._stop.wait(POLL_S):
            call, now = self.activity.current, time.monotonic()
            if call is None or now - call.since < CHECK_AFTER_S:
                seen = None
                continue
            if seen is None and now - asked < CHECK_AFTER_S:
                continue  # a long call of a correct job: ask the store every CHECK_AFTER_S at most
            asked = now
            try:
                opened = self._open_call()
                if opened is None:
                    seen = None
                elif seen is None or seen[:2] != (call.seq, opened[0]):
                    seen = (call.seq, opened[0], now)
                elif now - seen[2] >= grace_s():
                    self._report(opened[0], opened[1], call, now)
                    return
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending, nothing left to watch
                return

    def _open_call(self) -> tuple[int, dict[str, Any]] | None:
        """The next checkpoint call of this rank when some rank has already entered it."""
        call = int(self._store.add(call_counter_key(self.rank), 0)) + 1
        if not self._store.check([open_key(call)]):
            return None
        return call, json.loads(self._store.get(open_key(call)))

    def _report(self, call: int, opened: dict[str, Any], engine_call: EngineCall, now: float) -> None:
        op = opened["op"]
        doing = f"in {engine_call.what} (step {engine_call.step}) for {now - engine_call.since:.0f}s"
        absent = json.dumps({"absent": doing})
        others = [r for r in range(self.world_size) if r != self.rank]
        present = [r for r in others if self._store.check([phase_key(call, op, ENTRY_PHASE, r)])]
        verdict = (
            f"{op} was called on rank(s) {present} but not on this rank ({self.rank}), which has been "
            f"{doing} instead. {op} is collective: call it on every rank, not only under "
            "`if rank == 0`."
        )
        # compare-and-set: if the main thread arrived after all, its own entry stands and nothing is reported. Once
        # it is set the others raise and exit (rank 0 takes the store with it), so the verdict is composed first
        activity = self.activity
        activity.reporting = True
        try:
            if self._store.compare_set(phase_key(call, op, ENTRY_PHASE, self.rank), "", absent).decode() == absent:
                activity.verdict = verdict
        finally:
            activity.reported.set()
