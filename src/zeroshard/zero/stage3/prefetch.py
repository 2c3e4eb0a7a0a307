"""Execution order of units and the prefetch / keep-alive policy, kept apart from the mechanism.

[Note: trace]
A step's trace is the sequence of unit uses: pre-forward events, then pre-backward events. The first
step records it; later steps compare each event with the record. While they match, the policy may
prefetch the next units of the recorded trace and keep a unit gathered when its next use is near.
When the order changes (control flow, eval vs train), prefetching stops until the end of the step
and the new order is recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefetchPolicy:
    """DeepSpeed's knobs, in elements: stage3_prefetch_bucket_size, stage3_max_live_parameters,
    stage3_max_reuse_distance."""

    bucket_numel: int
    max_live_numel: int
    max_reuse_distance: int
    log_invalidation: bool = False  # zero_optimization.log_trace_cache_warnings


@dataclass
class ExecutionTrace:
    recorded: list[int] | None = None
    current: list[int] = field(default_factory=list)
    matches: bool = True

    def record(self, unit: int) -> bool:
        """Append `unit`; whether this use invalidated a trace that was being followed (prefetching stops until
        the step ends and the new order is recorded)."""
        pos = len(self.current)
        self.current.append(unit)
        if self.recorded is None or pos >= len(self.recorded) or self.recorded[pos] != unit:
            invalidated = self.matches and self.recorded is not None
            self.matches = False
            return invalidated
        return False

    def end_step(self) -> None:
        if self.current and (not self.matches or self.recorded is None or len(self.current) != len(self.recorded)):
            self.recorded = list(self.current)
        self.current = []
        self.matches = True

    @property
    def usable(self) -> bool:
        return self.recorded is not None and self.matches

    def upcoming(self) -> Sequence[int]:
        """Units the recorded trace uses after the current position (empty when unusable)."""
        if not self.usable or self.recorded is None:
            return ()
        return self.recorded[len(self.current) :]


def units_to_prefetch(
    upcoming: Sequence[int], numel: Sequence[int], gathered: set[int], live_numel: int, policy: PrefetchPolicy
) -> list[int]:
    """The next units of the trace to start gathering: up to `bucket_numel`, within `max_live_numel`."""
    chosen: list[int] = []
    budget = 0
    for unit in upcoming:
        if unit in gathered or unit in chosen:
            continue
        if budget + numel[unit] > policy.bucket_numel or live_numel + budget + numel[unit] > policy.max_live_numel:
            break
        chosen.append(unit)
        budget += numel[unit]
    return chosen


def reused_soon(unit: int, upcoming: Sequence[int], numel: Sequence[int], policy: PrefetchPolicy) -> bool:
    """True when `unit` is used again before more than `max_reuse_distance` other elements are gathered, or next (a
    root unit's consecutive entries, [Note: root unit by module]: releasing to gather again at once saves nothing)."""
    distance = 0
    seen: set[int] = set()
    for other in upcoming:
        if other == unit:
            return distance == 0 or distance < policy.max_reuse_distance
        if other not in seen:
            seen.add(other)
            distance += numel[other]
            if distance >= policy.max_reuse_distance:
                return False
    return False
