"""The stage-3 optimizer step, one sub-group at a time, and the state each sub-group holds in memory.

With NVMe offload sub-group k+1 (its master, optimizer state and gradient shards) is read while k steps and
k-1 is written back, so at most three sub-groups are in memory; without it the same loop runs over memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from zeroshard.offload.gradients import GradientTier
from zeroshard.offload.residency import Residency
from zeroshard.optim import state_dtype
from zeroshard.zero.stage3.build import BuiltUnits, Piece, SubGroup
from zeroshard.zero.stage3.unit import ShardedUnit


class SubGroupPlan(Protocol):
    """What an optimizer that reaches across ranks in its step (Muon, LAMB) needs to hear of each sub-group."""

    def begin(self, units: list[ShardedUnit]) -> bool:
        """The stepper is about to step `units`; whether every rank must step them (holding elements or not)."""
        ...


class SubGroupStepper:
    def __init__(
        self,
        built: BuiltUnits,
        store: Residency,
        param_store: Residency,
        gradients: GradientTier,
        resident_state: frozenset[str] = frozenset(),
    ):
        self.units = built.units
        self.pieces = built.pieces
        self.sub_groups = built.sub_groups
        self.placeholders = built.placeholders
        self.store = store  # masters and optimizer state (and NVMe gradients): one entry per sub-group
        self.param_store = param_store  # compute shards: one entry per unit
        self.gradients = gradients
        self.optimizer: torch.optim.Optimizer | None = None
        # the optimizer's plan (Muon's matrices, LAMB's norms: stage3/norms.py): every rank steps a sub-group it names
        self.plan: SubGroupPlan | None = None
        self.host_copies_in_backward = 0  # units whose step found the host gradient copy already made
        # optimizer state that stays in memory when the rest of a sub-group's entry swaps out: Muon's momentum with
        # zero_optimization.save_muon_momentum_buffer_in_memory (DeepSpeed's), one read and write fewer per step
        self.resident_state = resident_state

    def step(self, scale: float, done: frozenset[int] = frozenset()) -> None:
        """Step every sub-group but those in `done` (stepped during backward: [Note: speculative host steps], which
        happens only with the optimizer state in memory), with the gradients times `scale`."""
        previous: list[ShardedUnit] = []
        keyed = self._keyed()
        for k, units in enumerate(self.store.in_turn(keyed, self.tensors)):
            if k == 0:
                self._start_reads(units)
            if k + 1 < len(keyed):
                self._start_reads(keyed[k + 1][1])
            if k in done:
                continue
            for unit in units:
                self.store.ready(unit.grad_key)
            self.step_sub_group(k, units, scale)
            for unit in units:  # not needed after the step (zero_grad follows): freed, not written
                if self.store.leaves_memory:  # the masters go to the swapper: let their copies finish first
                    unit.wait_published()
                self.store.drop(unit.grad_key)
            for unit in previous:  # compute shards on NVMe: the previous sub-group's writes are done
                unit.settle_shard()
            previous = units
        for unit in previous:
            unit.settle_shard()
        for unit in self.units:  # [Note: publishing a host master to the GPU]: no copy outlives the step
            unit.wait_published()

    def _keyed(self) -> list[tuple[str, list[ShardedUnit]]]:
        return [(g.key, g.units) for g in self.sub_groups]

    def _start_reads(self, units: list[ShardedUnit]) -> None:
        """Start reading what stepping `units` needs besides the optimizer store's entry: gradient shards, and
        masters that are the compute shards (fp32 with both tiers on NVMe)."""
        for unit in units:
            if not unit.grad_in_copy:  # else the step reads the host copy, not the released shard
                unit.grad_resident()
            if unit.master is unit.shard:
                unit.home.fetch(unit.key)

    def step_sub_group(self, k: int, units: list[ShardedUnit], scale: float, private: bool = False) -> None:
        """Step sub-group `k` (`units`, resident) and publish its masters. The empty stand-ins are stepped with the
        first sub-group so every rank's optimizer counts the same steps per group (its scalar state, e.g. Adam's
        step, is what checkpoints record per group). `private`: a gradient shard that serves as its own fp32 copy
        is left as it is (scaled into a temporary): the norm still reads it ([Note: speculative host steps])."""
        assert self.optimizer is not None
        for unit in units:
            unit.master_resident()
            self.host_copies_in_backward += unit.grad_copy_ready
        stepped = self.gradients_of(k, units, scale, private)
        for master, grad in stepped:
            master.grad = grad
        collective = self.plan is not None and self.plan.begin(units)
        if stepped or collective:
            state_dtype.step(self.optimizer, [master for master, _ in stepped])  # [Note: bf16 master weights]
        for master, _ in stepped:
            master.grad = None
        for unit in units:
            unit.publish()

    def gradients_of(
        self, k: int, units: list[ShardedUnit], scale: float, private: bool, stepped: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(master, the fp32 gradient its step applies) for sub-group `k`, the stand-ins with the first;
        `stepped`: the step already ran, so a host copy already holds its gradient times `scale`."""
        members = {u.index for u in units}
        out = [(p, torch.zeros_like(p)) for p in self.placeholders] if k == 0 else []
        for piece in self._pieces_of(members):
            unit = piece.unit
            copy = unit.grad_copy
            if copy is not None and copy is not unit.grad_shard:
                copy = copy.narrow(0, piece.offset, piece.grad.numel())
                out.append((piece.master, copy if stepped else self._for_step(piece, copy, unit, scale)))
            elif copy is not None and private and scale != 1.0:
                out.append((piece.master, piece.grad * scale))
            else:  # the shard itself serves (fp32 on the master's device), or a temporary
                copy = piece.grad if copy is not None else None
                out.append((piece.master, self._for_step(piece, copy, unit, scale)))
        return out

    def _for_step(self, piece: Piece, copy: torch.Tensor | None, unit: ShardedUnit, scale: float) -> torch.Tensor:
        return self.gradients.for_step(piece.grad, piece.master, copy, unit.grad_copy_ready, scale)

    def _pieces_of(self, members: set[int]) -> Iterator[Piece]:
        for pieces in self.pieces:
            for piece in pieces:
                if piece.unit.index in members:
                    yield piece

    def tensors(self, units: list[ShardedUnit], resident: bool = False) -> list[torch.Tensor]:
        """A sub-group's swap entry: masters (unless they are the compute shards) and optimizer state but for
        `resident_state` (`resident`: that part alone)."""
        out = [] if resident else [m for u in units for m in u.separate_master()]  # else with the compute shard
        if self.optimizer is not None:
            for piece in self._pieces_of({u.index for u in units}):
                state = self.optimizer.state.get(piece.master, {})
                out += [
                    v
                    for k, v in state.items()
                    if (k in self.resident_state) == resident and isinstance(v, torch.Tensor) and v.dim() > 0
                ]
        return out

    @contextmanager
    def all_resident(self, changes: bool = True) -> Iterator[None]:
        """Master weights and optimizer state in memory for the block (consolidation, export); with NVMe
        offload they are read in first and written back after (`changes=False`: freed, not written)."""
        shards = [(u.key, u) for u in self.units]
        with self.store.resident(self._keyed(), self.tensors, changes):
            with self.param_store.resident(shards, lambda u: u.stored(), changes):
                yield

    @contextmanager
    def resident(self, sub_group: SubGroup, changes: bool = True) -> Iterator[None]:
        """One sub-group's masters, optimizer state and compute shards in memory for the block (checkpoints
        handle the state this way, one sub-group at a time: [Note: state parts])."""
        with self.store.resident([(sub_group.key, sub_group.units)], self.tensors, changes):
            with self.param_store.resident([(u.key, u) for u in sub_group.units], lambda u: u.stored(), changes):
                yield

    def sub_group_of(self, unit: ShardedUnit) -> SubGroup:
        return next(g for g in self.sub_groups if unit in g.units)
