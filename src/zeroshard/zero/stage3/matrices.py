"""Muon's matrices at stage 3 ([Note: Muon on flat shards] in optim/muon.py).

The optimizer steps one master per (unit, group) this rank holds elements of, a sub-group of units at a time, every
rank the same sub-group. For a Muon group, the sub-group's matrices are the group's slots in those units; each
rank's elements of them are its masters of those units, concatenated in unit order, and its part of every unit is
known from the unit's layout (plan.py). One exchange per group and sub-group (zero/matrices.py) makes each matrix
whole on one rank and brings the orthogonalised pieces back. A rank that holds nothing of a sub-group still takes
part (it may own matrices), so the stepper calls the optimizer whenever the sub-group holds a Muon matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.optim.muon import Muon
from zeroshard.zero.matrices import Piece, ShardedMatrices
from zeroshard.zero.stage3.build import BuiltUnits
from zeroshard.zero.stage3.unit import ShardedUnit


class UnitMatrixPlan:
    """Which matrices the masters of the sub-group being stepped hold, and their exchange."""

    def __init__(
        self, built: BuiltUnits, muon_groups: set[int], shard_count: int, comm: Collectives, device: torch.device
    ):
        self.muon_groups = muon_groups
        self.shard_count = shard_count
        self.comm = comm if shard_count > 1 else None
        self.device = device
        self.masters = {(p.unit.index, g): p.master for g, pieces in enumerate(built.pieces) for p in pieces}
        self.units: list[ShardedUnit] = []
        self._exchanges: dict[tuple[int, tuple[int, ...]], tuple[ShardedMatrices, list, int] | None] = {}

    def begin(self, units: Sequence[ShardedUnit]) -> bool:
        """The stepper is about to step `units`; whether they hold a Muon matrix (then every rank steps)."""
        self.units = list(units)
        return any(self._slots(unit, g) for unit in self.units for g in self.muon_groups)

    def orthogonalized(
        self, group: int, blended: dict[int, torch.Tensor], orthogonalize: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        key = (group, tuple(unit.index for unit in self.units))
        if key not in self._exchanges:  # the same sub-groups every step: their layout is worked out once
            self._exchanges[key] = self._exchange(group)
        exchange = self._exchanges[key]
        if exchange is None:
            return {}
        matrices, mine, length = exchange
        mine = [(master, offset) for master, offset in mine if id(master) in blended]
        like = blended[id(mine[0][0])] if mine else torch.empty(0, device=self.device)  # the masters' tier
        flat = torch.zeros(length, dtype=like.dtype, device=like.device)
        for master, offset in mine:
            flat.narrow(0, offset, master.numel()).copy_(blended[id(master)])
        out = matrices.apply(flat, orthogonalize)
        return {id(master): out.narrow(0, offset, master.numel()) for master, offset in mine}

    def _exchange(self, group: int) -> tuple[ShardedMatrices, list[tuple[torch.Tensor, int]], int] | None:
        """Group `group`'s matrices in the current units: their exchange, this rank's masters with their offsets in
        its concatenation, and its length; None when the units hold none."""
        shapes: list[torch.Size] = []
        pieces: list[list[Piece]] = [[] for _ in range(self.shard_count)]
        at = [0] * self.shard_count  # where each rank's part of the next unit starts in its concatenation
        mine: list[tuple[torch.Tensor, int]] = []
        for unit in self.units if group in self.muon_groups else []:
            slots = self._slots(unit, group)
            if not slots:
                continue
            first = len(shapes)
            shapes += [unit.views[slot.index].shape for slot in slots]
            begin, end = next((b, e) for g, b, e in unit.layout.group_ranges if g == group)
            for rank in range(self.shard_count):
                parts = unit.layout.owned_parts(rank, begin, end)
                assert len(parts) <= 1, "a trainable group lies in one section of its unit"
                for lo, hi, _ in parts:
                    for j, slot in enumerate(slots):
                        b, e = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                        if b < e:
                            pieces[rank].append(Piece(first + j, b - slot.offset, e - slot.offset, at[rank] + b - lo))
                    if rank == unit.shard_rank:
                        mine.append((self.masters[(unit.index, group)], at[rank]))
                    at[rank] += hi - lo
        if not shapes:
            return None
        return ShardedMatrices(shapes, pieces, self.comm, self.device), mine, at[self.units[0].shard_rank]

    @staticmethod
    def _slots(unit: ShardedUnit, group: int) -> list:
        trainable = set(unit.trainable)
        return [slot for slot in unit.layout.slots if slot.group == group and slot.index in trainable]


def muon_plan(
    optimizer: torch.optim.Optimizer,
    built: BuiltUnits,
    group_options: Sequence[dict[str, Any]],
    comm: Collectives,
    device: torch.device,
) -> UnitMatrixPlan | None:
    """The plan a Muon optimizer steps this strategy's masters with (also set as its `plan`); None for any other."""
    if not isinstance(optimizer, Muon):
        return None
    muon_groups = {g for g, options in enumerate(group_options) if options.get("use_muon")}
    plan = UnitMatrixPlan(built, muon_groups, comm.world_size, comm, device)
    optimizer.plan = plan
    return plan
