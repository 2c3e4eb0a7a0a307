"""Rendezvous of every rank for save/load, through the process group's key-value store, with timeouts.

[Note: collective calls with a deadline]
`save_checkpoint` and `load_checkpoint` must be called on every rank. DeepSpeed hangs in a barrier
when one rank does not call them; here each phase is a rendezvous on the c10d store (TCPStore under
torchrun) with a deadline, so a missing rank is a `CheckpointError` naming the ranks that arrived and
those that did not. The store also carries small JSON payloads (tags, per-rank manifests, errors), so a
failure on one rank (a full disk, a corrupted file it alone reads) is reported on every rank instead of
leaving the others waiting in the next training collective.

The n-th checkpoint call of a rank uses keys under `zeroshard/checkpoint/<n>/<op>/`, with n counted per
rank in the store itself: ranks make their calls in the same order, so their n agree, and several
engines in one process never reuse a key. Entering call n also sets `zeroshard/checkpoint/<n>/open`,
which a rank that went on training instead finds: see [Note: one-rank checkpoint calls] (watch.py).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from zeroshard.checkpoint.errors import CheckpointError

ENTRY_TIMEOUT_ENV = "ZEROSHARD_CHECKPOINT_TIMEOUT"
WRITE_TIMEOUT_ENV = "ZEROSHARD_CHECKPOINT_WRITE_TIMEOUT"
DEFAULT_ENTRY_TIMEOUT_S = 300.0  # how long ranks may arrive apart at a save/load call
DEFAULT_WRITE_TIMEOUT_S = 3600.0  # how long the slowest rank may take to write or read its files
GRACE_ENV = "ZEROSHARD_CHECKPOINT_GRACE"
DEFAULT_GRACE_S = 5.0  # how long a rank may stay in one engine call after others entered a checkpoint call
ENTRY_PHASE = "start"  # the first phase of every call: where ranks arrive


def call_counter_key(rank: int) -> str:
    return f"zeroshard/checkpoint/calls/{rank}"


def open_key(call: int) -> str:
    return f"zeroshard/checkpoint/{call}/open"


def phase_key(call: int, op: str, phase: str, rank: int) -> str:
    return f"zeroshard/checkpoint/{call}/{op}/{phase}/{rank}"


def entry_timeout() -> float:
    return float(os.environ.get(ENTRY_TIMEOUT_ENV, DEFAULT_ENTRY_TIMEOUT_S))


def write_timeout() -> float:
    return float(os.environ.get(WRITE_TIMEOUT_ENV, DEFAULT_WRITE_TIMEOUT_S))


def grace_s() -> float:
    return float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))


def default_store() -> dist.Store | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    # The default group's store is not public API, but it is the rendezvous every rank already shares.
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class RankSync:
    """Phases of one collective checkpoint call. `op` names the call in error messages."""

    def __init__(
        self,
        op: str,
        rank: int,
        world_size: int,
        store: dist.Store | None = None,
        announce: bool = True,
        prefix: str = "",
    ) -> None:
        """`prefix`: the call's keys under it, apart from other groups' calls made at the same time (a pipeline's
        stages)."""
        self.op = op
        self.rank = rank
        self.world_size = world_size
        self.store = store if store is not None or world_size == 1 else default_store()
        if prefix and store is None and self.store is not None:
            self.store = dist.PrefixStore(prefix, self.store)
        if self.world_size > 1 and self.store is None:
            raise CheckpointError(f"{op}: world size {world_size} but torch.distributed is not initialised")
        self.call = 0
        if self.store is not None and world_size > 1:
            self.call = int(self.store.add(call_counter_key(rank), 1))
            if announce:  # not for a rank that only gives the call up: the others' watch must not take it as begun
                self.store.set(open_key(self.call), json.dumps({"op": op, "rank": rank}))

    def _key(self, phase: str, rank: int) -> str:
        return phase_key(self.call, self.op, phase, rank)

    def _arrive(self, payload: Any) -> None:
        """Post this rank's entry, unless the others already took it as absent ([Note: one-rank checkpoint
        calls]): they have raised, so waiting for them would hang."""
        assert self.store is not None
        mine = json.dumps(payload)
        if self.store.compare_set(self._key(ENTRY_PHASE, self.rank), "", mine).decode() != mine:
            raise CheckpointError(
                f"{self.op}: the other ranks stopped waiting for this rank ({self.rank}), which reached the call "
                f"more than {grace_s():.0f}s after them while inside an engine call; call it at the same point on "
                "every rank (raise ZEROSHARD_CHECKPOINT_GRACE if this rank is just that slow)"
            )

    def abandon(self, doing: str, overwrite: bool = False) -> None:
        """Arrive as failing, without waiting: the others' entry ends at once, naming `doing` ([Note: one-rank
        checkpoint calls] posts the same for a rank found training). `overwrite`: replace this rank's own arrival
        (its wait for the others failed: those still to come must not wait for it)."""
        if self.store is not None and self.world_size > 1:
            key, payload = self._key(ENTRY_PHASE, self.rank), json.dumps({"absent": doing, "failing": True})
            if overwrite:
                self.store.set(key, payload)
            else:
                self.store.compare_set(key, "", payload)

    def _raise_if_absent(self, payloads: list[Any]) -> None:
        absent = [(r, p["absent"]) for r, p in enumerate(payloads) if isinstance(p, dict) and "absent" in p]
        if not absent:
            return
        failing = [(r, p["absent"]) for r, p in enumerate(payloads) if isinstance(p, dict) and p.get("failing")]
        if failing:
            raise CheckpointError(
                f"{self.op}: " + "; ".join(f"rank {r} gave up ({what})" for r, what in failing) + "; `latest` is "
                "unchanged"
            )
        present = [r for r, p in enumerate(payloads) if not (isinstance(p, dict) and "absent" in p)]
        doing = "; ".join(f"rank {r} has been {what} instead" for r, what in absent)
        why = " (rank 0 writes the shared files itself)" if self.op == "save_checkpoint" else ""
        raise CheckpointError(
            f"{self.op} was called on rank(s) {present} only: {doing}. {self.op} is collective: call it on every "
            f"rank, not only under `if rank == 0`{why}."
        )

    def _wait(self, phase: str, ranks: list[int], timeout: float) -> None:
        assert self.store is not None
        keys = [self._key(phase, r) for r in ranks]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - the store raises several types on timeout
            missing = [r for r, key in zip(ranks, keys, strict=True) if not self.store.check([key])]
            if not missing:
                return
            arrived = sorted(set(range(self.world_size)) - set(missing))
            raise CheckpointError(
                f"{self.op}: rank(s) {missing} did not reach the '{phase}' phase within {timeout:.0f}s "
                f"(rank(s) {arrived} did). {self.op} is collective: call it on every rank, with the same "
                "arguments, and make sure no rank failed or exited."
            ) from None

    def _get(self, phase: str, rank: int) -> Any:
        assert self.store is not None
        return json.loads(self.store.get(self._key(phase, rank)))

    def all_gather(self, phase: str, payload: Any, timeout: float) -> list[Any]:
        """Every rank's JSON `payload`, on every rank."""
        if self.store is None or self.world_size == 1:
            return [payload]
        if phase == ENTRY_PHASE:
            self._arrive(payload)
        else:
            self.store.set(self._key(phase, self.rank), json.dumps(payload))
        self._wait(phase, list(range(self.world_size)), timeout)
        payloads = [self._get(phase, r) for r in range(self.world_size)]
        self._raise_if_absent(payloads)
        return payloads

    def gather(self, phase: str, payload: Any, timeout: float) -> list[Any] | None:
        """Every rank's payload on rank 0 (None elsewhere)."""
        if self.store is None or self.world_size == 1:
            return [payload]
        self.store.set(self._key(phase, self.rank), json.dumps(payload))
        if self.rank != 0:
            return None
        self._wait(phase, list(range(self.world_size)), timeout)
        gathered = [self._get(phase, r) for r in range(self.world_size)]
        for r in range(self.world_size):
            self.store.delete_key(self._key(phase, r))  # manifests can be large; free the store
        return gathered

    def leave(self, timeout: float) -> None:
        """The last exchange of a call: every rank acknowledges with a write and rank 0 returns after all of them.
        Rank 0 usually hosts the store (MASTER_ADDR launchers; torchrun's agent hosts it instead), so a rank 0
        that returned and exited while another rank still read its last key would reset that rank's connection."""
        self.gather("left", True, timeout)

    def scatter(self, phase: str, payloads: list[Any] | None, timeout: float) -> Any:
        """Rank 0's `payloads[r]` on rank r (`payloads`: rank 0's argument; None elsewhere)."""
        if self.store is None or self.world_size == 1:
            assert payloads is not None
            return payloads[0]
        if self.rank == 0:
            assert payloads is not None
            for r, payload in enumerate(payloads):
                self.store.set(self._key(phase, r), json.dumps(payload))
        try:
            self._wait(phase, [self.rank], timeout)
        except CheckpointError:
            raise CheckpointError(
                f"{self.op}: rank 0 did not reach the '{phase}' phase within {timeout:.0f}s"
            ) from None
        mine = self._get(phase, self.rank)
        self.store.delete_key(self._key(phase, self.rank))  # metadata can be large; free the store
        return mine

    @contextlib.contextmanager
    def in_turn(self, after: int | None, timeout: float, phase: str = "turn") -> Iterator[None]:
        """Run the block once rank `after` has left its own (None: at once), and let the next rank go when the block
        ends, raised or not: ranks that wait on each other in a chain take turns. Store keys only (no collective),
        so a rank whose block raised still passes its turn on and the call's next exchange reports the error. A call
        that takes turns twice names the second round's `phase` apart."""
        if self.store is None or self.world_size == 1:
            yield
            return
        try:
            if after is not None:
                try:
                    self._wait(phase, [after], timeout)
                except CheckpointError:
                    raise CheckpointError(
                        f"{self.op}: rank {after}, whose turn comes before this rank's ({self.rank}), did not "
                        f"finish it within {timeout:.0f}s"
                    ) from None
            yield
        finally:  # also when the wait failed: the ranks after this one are not left to time out in turn
            self.store.set(self._key(phase, self.rank), "1")

    def broadcast(self, phase: str, payload: Any, timeout: float) -> Any:
        """Rank 0's payload on every rank."""
        if self.store is None or self.world_size == 1:
            return payload
        if self.rank == 0:
            self.store.set(self._key(phase, 0), json.dumps(payload))
            return payload
        self._wait(phase, [0], timeout)
        return self._get(phase, 0)


def describe_errors(payloads: list[dict[str, Any]]) -> str:
    """`ranks [0, 1]: <message>; rank 3: <other message>` from per-rank payloads with an "error" entry."""
    by_message: dict[str, list[int]] = {}
    for rank, payload in enumerate(payloads):
        if payload.get("error"):
            by_message.setdefault(payload["error"], []).append(rank)
    return "; ".join(
        f"{'rank ' + str(ranks[0]) if len(ranks) == 1 else f'ranks {ranks}'}: {message}"
        for message, ranks in by_message.items()
    )
