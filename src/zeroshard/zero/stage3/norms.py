"""LAMB's per-parameter norms at stage 3 ([Note: LAMB on flat shards] in optim/lamb.py).

The optimizer steps one master per (unit, group) this rank holds elements of, a sub-group of units at a time, every
rank the same sub-group. The parameters of a group in the sub-group are its trainable slots in those units, numbered
in unit and slot order (the same on every rank); a master's pieces of them are known from the unit's layout
(plan.py). A rank that holds nothing of the sub-group still adds its zeros to the all-reduce, so the stepper calls the
optimizer whenever the sub-group holds a trainable parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.optim.lamb import Lamb
from zeroshard.zero.norms import reduce_on
from zeroshard.zero.stage3.build import BuiltUnits
from zeroshard.zero.stage3.matrices import muon_plan
from zeroshard.zero.stage3.unit import ShardedUnit


class UnitNormPlan:
    """Which parameters the masters of the sub-group being stepped hold pieces of."""

    def __init__(self, built: BuiltUnits, shard_count: int, comm: Collectives, device: torch.device):
        self.comm = comm if shard_count > 1 else None
        self.device = device
        self.masters = {(p.unit.index, g): p.master for g, pieces in enumerate(built.pieces) for p in pieces}
        self.units: list[ShardedUnit] = []
        self._segments: dict[tuple[int, tuple[int, ...]], tuple[int, dict[int, list[tuple[int, int, int]]]]] = {}

    def begin(self, units: Sequence[ShardedUnit]) -> bool:
        """The stepper is about to step `units`; whether they hold a trainable parameter (then every rank steps)."""
        self.units = list(units)
        return any(unit.trainable for unit in self.units)

    def segments(
        self, group: int, stepped: Sequence[torch.Tensor]
    ) -> tuple[int, dict[int, list[tuple[int, int, int]]]]:
        key = (group, tuple(unit.index for unit in self.units))
        if key not in self._segments:  # the same sub-groups every step: worked out once
            self._segments[key] = self._layout(group)
        return self._segments[key]

    def _layout(self, group: int) -> tuple[int, dict[int, list[tuple[int, int, int]]]]:
        count = 0
        out: dict[int, list[tuple[int, int, int]]] = {}
        for unit in self.units:
            trainable = set(unit.trainable)
            slots = [slot for slot in unit.layout.slots if slot.group == group and slot.index in trainable]
            if not slots:
                continue
            ranges = [(b, e) for g, b, e in unit.layout.group_ranges if g == group]
            parts = unit.layout.owned_parts(unit.shard_rank, *ranges[0]) if ranges else []
            master = self.masters.get((unit.index, group))
            for lo, hi, _ in parts if master is not None else []:
                pieces = out.setdefault(id(master), [])
                for k, slot in enumerate(slots):
                    b, e = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                    if b < e:
                        pieces.append((b - lo, e - b, count + k))
            count += len(slots)
        return count, out

    def reduce(self, sums: torch.Tensor) -> None:
        if self.comm is not None:
            reduce_on(self.comm, self.device, sums)


def step_plan(
    optimizer: torch.optim.Optimizer,
    built: BuiltUnits,
    group_options: Sequence[dict[str, Any]],
    comm: Collectives,
    device: torch.device,
) -> Any:
    """The plan the optimizer steps this strategy's masters with (set as its `plan`): Muon's matrices, LAMB's norms;
    None for an elementwise optimizer."""
    if isinstance(optimizer, Lamb):
        optimizer.plan = UnitNormPlan(built, comm.world_size, comm, device)
        return optimizer.plan
    return muon_plan(optimizer, built, group_options, comm, device)
