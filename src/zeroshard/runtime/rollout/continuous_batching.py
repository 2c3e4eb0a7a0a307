"""Slot scheduling for continuous batching (DeepSpeed 0.19.8's `deepspeed.runtime.rollout.continuous_batching`).

A decode batch has `max_batch_size` rows. Each transition retires finished requests (their rows are dropped, the
survivors keep their order and move up), then admits waiting requests first come, first served into the rows freed
at the end. The scheduler only says which rows survive and which requests enter; the caller compacts its key-value
cache with `keep_slots` and prefills the admitted prompts into `admitted_slots`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ContinuousBatchRequest:
    """A request waiting for, or holding, a row of the decode batch."""

    request_id: Hashable


@dataclass(frozen=True)
class ContinuousBatchUpdate:
    """One transition. `keep_slots` are the surviving rows' indices in the previous batch (in their order), `retired`
    the finished requests' ids, `admitted` the requests that entered (the last rows of `active`)."""

    active: tuple[ContinuousBatchRequest, ...]
    keep_slots: tuple[int, ...]
    retired: tuple[Hashable, ...]
    admitted: tuple[ContinuousBatchRequest, ...]

    @property
    def active_ids(self) -> tuple[Hashable, ...]:
        return tuple(r.request_id for r in self.active)

    @property
    def admitted_slots(self) -> tuple[int, ...]:
        """The rows to prefill the admitted requests into."""
        return tuple(range(len(self.active) - len(self.admitted), len(self.active)))


class ContinuousBatchScheduler:
    """First come, first served admission into at most `max_batch_size` rows, each request retiring after
    `max_new_tokens` decode steps (`advance`) or when the caller names it finished (an EOS).

    Example:
        >>> s = ContinuousBatchScheduler(max_batch_size=1, max_new_tokens=2)
        >>> for i in range(2):
        ...     s.submit(ContinuousBatchRequest(i))
        >>> s.schedule().active_ids, s.advance().active_ids, s.advance().active_ids
        ((0,), (0,), (1,))
    """

    def __init__(self, max_batch_size: int, max_new_tokens: int) -> None:
        if max_batch_size <= 0:
            raise ValueError(f"ContinuousBatchScheduler: max_batch_size must be positive, got {max_batch_size}")
        if max_new_tokens <= 0:
            raise ValueError(f"ContinuousBatchScheduler: max_new_tokens must be positive, got {max_new_tokens}")
        self.max_batch_size = max_batch_size
        self.max_new_tokens = max_new_tokens
        self._waiting: deque[ContinuousBatchRequest] = deque()
        self._rows: list[ContinuousBatchRequest] = []
        self._decoded: dict[Hashable, int] = {}  # tokens decoded so far, per active request
        self._ids: set[Hashable] = set()  # waiting and active

    @property
    def active(self) -> tuple[ContinuousBatchRequest, ...]:
        return tuple(self._rows)

    @property
    def pending(self) -> tuple[ContinuousBatchRequest, ...]:
        return tuple(self._waiting)

    def submit(self, request: ContinuousBatchRequest) -> None:
        if not isinstance(request, ContinuousBatchRequest):
            raise TypeError(
                f"ContinuousBatchScheduler.submit: takes a ContinuousBatchRequest, got {type(request).__name__}"
            )
        if request.request_id in self._ids:
            raise ValueError(f"ContinuousBatchScheduler.submit: duplicate request_id: {request.request_id!r}")
        self._ids.add(request.request_id)
        self._waiting.append(request)

    def _check_active(self, ids: Iterable[Hashable]) -> set[Hashable]:
        named = set(ids)
        active = {r.request_id for r in self._rows}
        for request_id in named:
            if request_id not in active:
                raise ValueError(f"ContinuousBatchScheduler: finished request is not active: {request_id!r}")
        return named

    def schedule(self, finished_ids: Iterable[Hashable] = ()) -> ContinuousBatchUpdate:
        """Retire `finished_ids`, then fill the free rows from the waiting requests."""
        finished = self._check_active(finished_ids)
        kept = [(slot, r) for slot, r in enumerate(self._rows) if r.request_id not in finished]
        retired = tuple(r.request_id for r in self._rows if r.request_id in finished)
        admitted: list[ContinuousBatchRequest] = []
        while self._waiting and len(kept) + len(admitted) < self.max_batch_size:
            request = self._waiting.popleft()
            admitted.append(request)
            self._decoded[request.request_id] = 0
        self._rows = [r for _, r in kept] + admitted
        for request_id in retired:
            del self._decoded[request_id]
            self._ids.discard(request_id)
        return ContinuousBatchUpdate(tuple(self._rows), tuple(slot for slot, _ in kept), retired, tuple(admitted))

    def advance(self, finished_ids: Iterable[Hashable] = ()) -> ContinuousBatchUpdate:
        """One decode step for every active request; those at `max_new_tokens` retire with `finished_ids`."""
        finished = self._check_active(finished_ids)
        for r in self._rows:
            self._decoded[r.request_id] += 1
            if self._decoded[r.request_id] >= self.max_new_tokens:
                finished.add(r.request_id)
        return self.schedule(finished)


__all__ = ["ContinuousBatchRequest", "ContinuousBatchScheduler", "ContinuousBatchUpdate"]
