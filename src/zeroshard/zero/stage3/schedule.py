"""When stage-3 units are gathered and released: the mechanism that carries out the prefetch policy.

Forward: a unit's pre-forward gathers it (waiting for a prefetch if one is in flight) and starts gathering the
next units of the recorded trace; its post-forward releases it unless the trace says it is reused soon. Backward:
a hook on the unit's outputs gathers it again. The policy (what to prefetch, what to keep) is in prefetch.py.

[Note: live parameter limit]
`stage3_max_live_parameters` bounds the gathered (non-persistent) elements: prefetching stops below it, a unit
is kept gathered for reuse only if that stays within it, and before a gather would pass it the kept units whose
next use is farthest are released. Units in use (between their pre- and post-hooks), pinned or persistent are
never released early, so a unit larger than the limit still runs.

[Note: recompute]
Activation checkpointing runs a unit's forward again inside backward (a forward while the autograd engine
executes a graph task). Such a recompute uses the unit for its own backward, which follows at once: it is
left gathered after its forward (its backward releases it; no release-then-regather) and is recorded in the
trace like any event, so the next step's prefetch brings it in ahead of the recompute. Only forwards whose
backward will run are counted for `last_backward`: not a forward under no_grad (a reentrant checkpoint's
first pass), not a recompute at its forward. A reentrant recompute is backwarded (its own graph), so it is
counted when that backward starts (`pre_backward(recomputed=True)`); a non-reentrant recompute's graph is
discarded, so its hooks never fire and the original forward's count stands.
A unit used both inside and outside a reentrant checkpoint (the root unit split by module, [Note: root unit by
module], whose entries a checkpointed method of the root calls) would reach zero after the backward of its use
outside and be reduced before the recompute's gradients arrived. So a forward under no_grad inside a forward
that began with grad enabled (what a reentrant checkpoint's first pass is) is counted at once, as a recompute
expected later, and that recompute's backward then takes the expected count instead of adding one. A no_grad
region that is not a checkpoint leaves its count standing: the unit is reduced when backward ends.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from zeroshard.comm.divergence import DivergenceWatch
from zeroshard.errors import ZeroshardError
from zeroshard.offload.residency import Residency
from zeroshard.utils.logging import get_logger
from zeroshard.zero.stage3.prefetch import ExecutionTrace, PrefetchPolicy, reused_soon, units_to_prefetch
from zeroshard.zero.stage3.unit import ShardedUnit, UnitState

if TYPE_CHECKING:
    from zeroshard.zero.zeropp.weights import UnitGathers


logger = get_logger(__name__)


class GatherSchedule:
    def __init__(
        self,
        units: list[ShardedUnit],
        policy: PrefetchPolicy,
        watch: DivergenceWatch,
        param_store: Residency,
        read_ahead: tuple[int, int],
        overlap: bool,
    ):
        self.units = units  # each gathered over its own group (`unit.comm`)
        self.policy = policy
        self.watch = watch
        self.param_store = param_store
        self.read_ahead = read_ahead  # offload_param on NVMe: (units, elements) read ahead of use
        self.overlap = overlap
        self.trace = ExecutionTrace()
        self.suspended = 0  # inside whole-model blocks: [Note: forwards of the whole gathered model]
        self._numels = [u.numel for u in units]  # fixed once the units exist; read on every event
        self.forward_calls: dict[int, int] = {}
        self.expected_recomputes: dict[int, int] = {}  # [Note: recompute] counted at a no_grad first pass
        self.forward_with_grad = False  # the current forward began with grad enabled
        self.in_backward = False
        self._kept: set[int] = set()  # units left gathered after use because the trace reuses them soon
        self.peak_gathered_numel = 0  # largest sum of gathered (non-persistent) unit sizes seen
        self.zeropp: UnitGathers | None = None  # ZeRO++ qwZ/hpZ gathers (zero/zeropp/weights.py)
        self.params_away = False  # offload_states(lp_params): shards are empty storages ([Note: offloaded states])

    def _refuse_away(self, what: str) -> None:
        if self.params_away:
            raise ZeroshardError(f"{what}: lp_params offloaded by offload_states(); call engine.reload_states() first")

    # -- events ----------------------------------------------------------------------------------------
    def root_pre_forward(self) -> None:
        """A new forward: close the previous trace (a forward without backward, e.g. evaluation)."""
        self._refuse_away("a forward")
        if not self.in_backward:
            self.forward_with_grad = torch.is_grad_enabled()
        if self.in_backward or not self.trace.current:
            return
        self.trace.end_step()
        for unit in self.units:
            unit.release()
        self._kept.clear()
        if not self.suspended:  # a forward with grad before a whole-model block keeps its count for its backward
            self.forward_calls.clear()
            self.expected_recomputes.clear()

    def pre_forward(self, unit: ShardedUnit, counted: bool = True) -> None:
        self._record(unit)
        if counted and not recomputing():  # [Note: recompute]
            if torch.is_grad_enabled():
                self._count_forward(unit)
            elif self.forward_with_grad and not self.suspended:  # a reentrant checkpoint's first pass, presumably
                self._count_forward(unit)
                self.expected_recomputes[unit.index] = self.expected_recomputes.get(unit.index, 0) + 1
        self._use(unit)

    def _record(self, unit: ShardedUnit) -> None:
        position = len(self.trace.current)
        if self.trace.record(unit.index) and self.policy.log_invalidation:
            recorded = self.trace.recorded or []
            expected = self.units[recorded[position]].name if position < len(recorded) else "the end of the trace"
            logger.warning(
                f"zeroshard: stage-3 prefetch trace invalidated at use {position} of the step: unit {unit.name!r} "
                f"ran where the recorded order had {expected!r}; prefetching stops until the step ends and the new "
                "order is recorded (zero_optimization.log_trace_cache_warnings)"
            )

    def hold(self, unit: ShardedUnit) -> None:
        """Gather `unit` outside the trace: the root unit around a probing forward ([Note: root unit by module])."""
        self._use(unit)

    def post_forward(self, unit: ShardedUnit) -> None:
        if recomputing():  # [Note: recompute] its backward follows and releases it
            return
        if reused_soon(unit.index, self.trace.upcoming(), self._numels, self.policy):
            if self._live_numel() <= self.policy.max_live_numel:
                self._kept.add(unit.index)
                return
        unit.release()

    def pre_backward(self, unit: ShardedUnit, recomputed: bool = False) -> None:
        self.in_backward = True
        if recomputed:  # [Note: recompute] a reentrant recompute's own backward
            expected = self.expected_recomputes.get(unit.index, 0)
            if expected:
                self.expected_recomputes[unit.index] = expected - 1
            else:
                self._count_forward(unit)
        self._record(unit)
        self._use(unit)

    def last_backward(self, unit: ShardedUnit) -> bool:
        """The unit's backward ran for one of its forward calls; True after the last."""
        remaining = self.forward_calls.get(unit.index, 1) - 1
        self.forward_calls[unit.index] = remaining
        return remaining <= 0

    def end_backward(self) -> None:
        """Everything is released after a backward; the step's trace is complete."""
        for unit in self.units:
            unit.end_backward()
            unit.release()
        self._kept.clear()
        self.forward_calls.clear()
        self.expected_recomputes.clear()
        self.in_backward = False
        self.trace.end_step()

    # -- mechanism -------------------------------------------------------------------------------------
    def _count_forward(self, unit: ShardedUnit) -> None:
        self.forward_calls[unit.index] = self.forward_calls.get(unit.index, 0) + 1

    def _use(self, unit: ShardedUnit) -> None:
        self._kept.discard(unit.index)
        if unit.state is UnitState.SHARDED:
            self._make_room(unit.numel, exclude=unit.index)
            self.gather(unit)
        self.wait_gathered(unit)
        gathered = {u.index for u in self.units if u.state is not UnitState.SHARDED}
        for index in units_to_prefetch(self.trace.upcoming(), self._numels, gathered, self._live_numel(), self.policy):
            self.gather(self.units[index])
        self._read_ahead()

    def _live_numel(self) -> int:
        return sum(u.numel for u in self.units if u.state is not UnitState.SHARDED and not u.persistent)

    def _make_room(self, numel: int, exclude: int) -> None:
        """[Note: live parameter limit] release kept units, farthest next use first, until `numel` more fits."""
        if not self._kept or self._live_numel() + numel <= self.policy.max_live_numel:
            return
        upcoming = list(self.trace.upcoming())

        def next_use(index: int) -> int:
            return upcoming.index(index) if index in upcoming else len(upcoming)

        for index in sorted(self._kept - {exclude}, key=next_use, reverse=True):
            if self._live_numel() + numel <= self.policy.max_live_numel:
                break
            self._kept.discard(index)
            self.units[index].release()

    def _read_ahead(self) -> None:
        """offload_param on NVMe: start reading the shards of the next units of the trace (up to
        buffer_count units and max_in_cpu elements), so their gathers do not wait for the disk."""
        max_units, max_numel = self.read_ahead
        budget, count = 0, 0
        for index in dict.fromkeys(self.trace.upcoming()):
            unit = self.units[index]
            if unit.state is not UnitState.SHARDED:
                continue
            budget += unit.layout.shard_numel
            count += 1
            if count > max_units or budget > max_numel:
                break
            self.param_store.fetch(unit.key)

    def gather(self, unit: ShardedUnit, exact: bool = False, why: str = "") -> None:
        """`exact`: full-precision values whatever ZeRO++ does for training gathers (state_dict, GatheredParameters);
        `why`: the caller's call, named in a divergence report."""
        self._refuse_away(f"a gather of unit {unit.name!r}")
        self.watch.gather_log.append(unit.index)
        collect = self.zeropp.collect(unit) if self.zeropp is not None and not exact else None
        unit.gather(async_op=self.overlap, collect=collect, why=why)
        self.peak_gathered_numel = max(self.peak_gathered_numel, self._live_numel())

    def wait_gathered(self, unit: ShardedUnit) -> None:
        if unit.state is UnitState.GATHERING:
            unit.after_copy_in()  # before the handle's finishers run on this stream
            self.watch.wait(unit._pending, f"all-gather of unit {unit.name!r}")
            unit.wait_gathered()

    def refresh(self, unit: ShardedUnit) -> None:
        """A gathered unit (the persistent one) gets its shards' new values (after a step or a load)."""
        unit.state = UnitState.SHARDED
        unit.gather(async_op=False)
        unit.wait_gathered()

    # -- whole-model gathering -------------------------------------------------------------------------
    def pin(self, units: Sequence[ShardedUnit], why: str) -> None:
        """Gather `units` (every rank must call this: `why` names the call) and keep them gathered until `unpin`."""
        self._refuse_away(why)
        for unit in units:
            unit.pins += 1
            if unit.state is UnitState.SHARDED:
                self.gather(unit, exact=True, why=why)
        for unit in units:
            self.wait_gathered(unit)

    def suspend_trace(self) -> tuple[ExecutionTrace, set[int]]:
        """Forwards from now on (generation with every unit pinned) neither record into the step's trace nor close
        it; `resume_trace(saved)` puts back the recorded order and the reuse set. The backward counts stay: a
        forward with grad inside counts for its backward after the block."""
        saved = self.trace, set(self._kept)
        self.trace = ExecutionTrace()
        self.suspended += 1
        return saved

    def resume_trace(self, saved: tuple[ExecutionTrace, set[int]]) -> None:
        self.trace, self._kept = saved
        self.suspended -= 1

    def release_all(self) -> None:
        """Release every unit not pinned or persistent, the ones kept for reuse too (a forward without a backward,
        under no_grad, leaves those gathered until the next forward)."""
        self._kept.clear()
        for unit in self.units:
            unit.release()

    def unpin(self, units: Sequence[ShardedUnit], hand_over: bool = True) -> None:
        """`hand_over`: the caller may keep what it read ([Note: gathered storage]); False where it keeps nothing."""
        for unit in units:
            unit.pins = max(0, unit.pins - 1)
            unit.release(hand_over=hand_over)


def recomputing() -> bool:
    """True while the autograd engine runs a backward on this thread: a forward now is a recompute
    ([Note: recompute]); torch.utils.checkpoint tells its own recomputation apart the same way."""
    return bool(torch._C._current_graph_task_id() != -1)


def settle_gathers(units: Sequence[ShardedUnit], timeout_s: float = 60.0) -> None:
    """[Note: nothing in flight at exit]
    A forward that no backward follows (evaluation, generation, a script's last test pass) leaves the prefetches
    the recorded trace asked for in flight: the next forward would wait for them, but a process may end first.
    Exiting with a collective pending aborts the rank in the backend's teardown (gloo: "terminate called without
    an active exception", SIGABRT) while its peers finish normally. Every rank issued the same prefetches, so
    each waits for its own at exit (bounded: a peer that died makes the wait fail, which is ignored there)."""
    for unit in units:
        pending = unit._pending
        if unit.state is not UnitState.GATHERING or pending is None:
            continue
        try:
            unit.after_copy_in()  # before the handle's finishers run on this stream
            pending.wait(datetime.timedelta(seconds=timeout_s))  # type: ignore[call-arg]
            unit.wait_gathered()  # done: only the bookkeeping is left
        except Exception:  # noqa: BLE001 - at exit a failed wait (a peer gone) has nobody to report to
            return


def settle_live_gathers(units: Sequence[weakref.ref[ShardedUnit]]) -> None:
    """`settle_gathers` over the units still alive (a finalizer's: it must not keep them)."""
    settle_gathers([u for u in (ref() for ref in units) if u is not None])
