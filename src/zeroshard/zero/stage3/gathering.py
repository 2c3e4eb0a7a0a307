"""Stage 3's whole-model and per-parameter gathering for the caller: `gathered()` (generation), `GatheredParameters`
(`gather_begin` / `gather_end`), `state_dict()`'s gather, `empty_partition_cache()`. A mixin of `Stage3Strategy`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.comm.agreement import CallAgreement
from zeroshard.comm.collectives import Collectives
from zeroshard.utils.logging import get_logger
from zeroshard.zero.stage3.schedule import GatherSchedule
from zeroshard.zero.stage3.step import SubGroupStepper
from zeroshard.zero.stage3.unit import ShardedUnit, UnitState

logger = get_logger(__name__)


class Stage3Gathering:
    """Gathering on the caller's behalf; the units, schedule and stepper are the strategy's."""

    units: list[ShardedUnit]
    schedule: GatherSchedule
    stepper: SubGroupStepper
    comm: Collectives
    agreement: CallAgreement  # [Note: gathering calls agree first]
    _untraced: int  # inside whole-model blocks: [Note: forwards of the whole gathered model]
    _state_dict_gathered: list[bool]
    _state_dict_required = 0  # inside save_state_dict: [Note: a state_dict() made alone] does not apply
    module: nn.Module
    device: torch.device
    speculation: Any = None  # super_offload's worker ([Note: speculative host steps])

    # -- whole-model gathering ---------------------------------------------------------------------
    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered for the block (generation): [Note: forwards of the whole gathered model]."""
        held = self.gather_begin([p for unit in self.units for p in unit.params], "a whole-model gather (generation)")
        try:
            yield
        finally:
            self.gather_end(held, None)

    def release_gathered(self) -> None:
        """Every unit not pinned (GatheredParameters, generation) goes back to its shard; the persistent unit stays
        gathered by design ([Note: units] in plan.py: it is never released, and its blocks run without a gather)."""
        self.schedule.release_all()

    def on_state_dict_pre(self, keep_vars: bool) -> None:
        """`state_dict()` gathers every unit (collective); `state_dict(keep_vars=True)` asks for the module's
        own tensors (e.g. to catalogue them) and gets the placeholders without communication.

        [Note: a state_dict() made alone]
        DeepSpeed's stage-3 `state_dict()` communicates nothing and returns the placeholders, and DeepSpeed-Chat
        relies on it: `save_hf_format` runs `model.state_dict()` on rank 0 alone, while the other ranks go straight
        to the ZeRO-3 save (`GatheredParameters` over each parameter), whose file then replaces rank 0's. zeroshard's
        gathers the whole model when every rank calls it, so its agreement marks it optional: when every other rank is
        in the same `GatheredParameters`-like block, the `state_dict()` calls that differ stand down and return
        DeepSpeed's placeholders (a warning names the others' call), and the others' block is agreed again with those
        ranks' next call. Beside a block over some of the parameters they stand down even where they would gather
        the same units (a model of one unit, DeepSpeed-Chat's reward model at a small size); only a block over the
        whole model (generation's) pairs with an equal `state_dict()`. Against any other call it is a mismatch as
        before; `save_16bit_model`'s never stands down; a `state_dict()` met by no gathering call times out, and one
        that stood down with no call after is named."""
        optional = self._state_dict_required == 0  # save_16bit_model's must gather
        gathers = not keep_vars and self._agree("state_dict()", self.units, optional=optional)  # nothing held yet
        self._state_dict_gathered.append(gathers)
        if gathers:
            self.schedule.pin(self.units, "state_dict(), a collective at stage 3")
        elif not keep_vars:
            logger.warning(
                "state_dict() at stage 3 on this rank while the other ranks made %s: it returns the placeholders, as "
                "DeepSpeed's does ([Note: a state_dict() made alone]); call it on every rank for the weights",
                self.agreement.stood_down_for,
            )

    def full_state_dict(self) -> dict[str, Any]:
        return self._gathered_state(keep=True)

    def save_state_dict(self, keep: bool) -> dict[str, Any]:
        return self._gathered_state(keep)

    def _gathered_state(self, keep: bool) -> dict[str, Any]:
        """`save_16bit_model`'s weights: `state_dict()`'s names (buffers, extra state, a tied weight under each of its
        names) with whole values in the compute dtype on the host of the ranks that `keep` them, every rank taking
        part (never standing down to placeholders). The units are gathered one at a time, as DeepSpeed gathers layer
        by layer: a `state_dict()` gathers them all at once, which held the whole model on every rank's device, and a
        copy of it. A module whose own state-dict code gives a parameter's name another tensor (a cast, a packed
        form) is served by that `state_dict()` after all."""
        named = self.module.state_dict(keep_vars=True)  # the module's own tensors: nothing gathered
        held = {id(p) for unit in self.units for p in unit.params}
        names = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        if any(isinstance(v, torch.Tensor) and id(v) not in held and n in names for n, v in named.items()):
            return self._state_dict_at_once(keep)
        needed = [u.index for u in self.units if u.state is UnitState.SHARDED]
        if needed:  # gathers of its own kind: a lone state_dict() on a rank stands down beside it, not pairs with it
            self.agreement.agree("save_16bit_model", f"all-gather of units {needed}, one at a time", role="block")
        whole: dict[int, torch.Tensor] = {}
        for unit in self.units:
            self.schedule.pin([unit], "save_16bit_model, a collective at stage 3")
            try:
                whole.update({id(p): p.detach().to("cpu", copy=True) for p in unit.params} if keep else {})
            finally:
                self.schedule.unpin([unit], hand_over=False)  # nothing is held: no new buffer for the views
        out: dict[str, Any] = {}
        named_before: set[int] = set()
        for name, value in named.items() if keep else ():
            copy = whole.get(id(value)) if isinstance(value, torch.Tensor) else None
            if not isinstance(value, torch.Tensor):
                copy = value
            elif copy is None:  # a buffer (whole on every rank)
                copy = value.detach().to("cpu", copy=True)
            elif id(value) in named_before:  # a tied weight: one tensor per name, as state_dict() gives them
                copy = copy.clone()
            named_before.add(id(value))
            out[name] = copy
        return out

    def _state_dict_at_once(self, keep: bool) -> dict[str, Any]:
        self._state_dict_required += 1
        try:
            state = dict(self.module.state_dict())
        finally:
            self._state_dict_required -= 1
        return (
            {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            if keep
            else {}
        )

    def detach_state(self, state_dict: dict[str, Any]) -> None:
        """state_dict post-hook: full tensors are copied out before the units are released."""
        if not (self._state_dict_gathered and self._state_dict_gathered.pop()):
            return
        for key, value in list(state_dict.items()):
            if isinstance(value, torch.Tensor):
                state_dict[key] = value.detach().clone()
        self.schedule.unpin(self.units)

    # -- gathering (GatheredParameters) ------------------------------------------------------------------
    def gather_begin(
        self, params: Sequence[torch.Tensor], call: str = "", modifier_rank: int | None = None
    ) -> list[Any]:
        """[Note: forwards of the whole gathered model]
        While every unit is pinned (`gathered()`, generation; `GatheredParameters` over all of the model's
        parameters, DeepSpeed's and TRL's way to generate at ZeRO-3), forwards communicate nothing: they stay out of
        the prefetch trace (the training step's recorded order survives) and out of the per-step divergence digest,
        so ranks may generate different numbers of tokens without `synced_gpus`."""
        if modifier_rank is not None and self.speculation is not None:  # the masters it writes were stepped already
            self.speculation.check_unchanged(call or f"GatheredParameters(modifier_rank={modifier_rank})")
        units = self.units_of(params)
        held = {id(p) for p in params}
        every = len(units) == len(self.units) and all(id(p) in held for u in self.units for p in u.params)
        self._agree(call or f"GatheredParameters over {len(params)} parameter(s)", units, modifier_rank, whole=every)
        self.schedule.pin(units, "GatheredParameters")
        if len(units) < len(self.units):
            return units
        self._untraced += 1
        return [_WholeModel(self.schedule.suspend_trace()), *units]

    def gather_end(self, held: list[Any], modifier_rank: int | None) -> None:
        whole = held[0] if held and isinstance(held[0], _WholeModel) else None
        units = held[1:] if whole is not None else held
        try:
            if modifier_rank is not None and units:
                self.agreement.before_broadcast(modifier_rank, [u.index for u in units])
                with torch.no_grad():
                    for unit in units:
                        unit.comm.broadcast(unit.full.data, src=self.modifier_in(unit, modifier_rank))
                        self.write_back(unit)
        finally:
            if whole is not None:
                self.schedule.resume_trace(whole.saved)
                self._untraced -= 1
            self.schedule.unpin(units)

    def consolidated_value(
        self,
        param: nn.Parameter,
        value: torch.Tensor,
        out: dict[int, torch.Tensor] | None,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        """`consolidated_params`: `param`'s whole fp32 master `value` (its unit's gather) into `out` (None: this
        rank keeps nothing), in `dtype` on `device` (default: the compute device). A subclass may communicate here."""
        if out is not None:
            out[id(param)] = value.to(device or self.device, dtype, copy=True)

    def modifier_in(self, unit: ShardedUnit, modifier_rank: int) -> int:
        """The global rank whose values of `unit` a `modifier_rank` block keeps: the modifier's own, for a unit
        sharded over the strategy's group ([Note: units apart] in plan.py: a subclass that makes other groups says)."""
        assert unit.comm is self.comm, f"unit {unit.name!r} is sharded over another group"
        return modifier_rank

    def _agree(
        self,
        call: str,
        units: Sequence[ShardedUnit],
        modifier_rank: int | None = None,
        optional: bool = False,
        whole: bool = False,
    ) -> bool:
        """Before a caller's call gathers: [Note: gathering calls agree first]. Units gathered already (the
        persistent one, or inside a forward) communicate nothing. False: an `optional` call stood down. `whole`: a
        block over every parameter of the model."""
        needed = [u.index for u in units if u.state is UnitState.SHARDED]
        return self.agreement.before_block(call, needed, modifier_rank, len(units), optional, whole)

    def units_of(self, params: Sequence[torch.Tensor]) -> list[ShardedUnit]:
        wanted = {id(p) for p in params}
        return [u for u in self.units if any(id(p) in wanted for p in u.params)]

    def write_back(self, unit: ShardedUnit) -> None:
        """After the full parameters of a gathered unit were modified: update this rank's shards, and a separate
        master where the compute values changed only (elsewhere it keeps its fp32 bits: the compute values are the
        master rounded, and the unit's other parameters lost their low bits to a rounded copy)."""
        group = self.stepper.sub_group_of(unit)
        with self.stepper.store.resident([(group.key, group.units)], self.stepper.tensors):
            kept = unit.master.clone() if unit.master is not unit.shard and unit.master.numel() else None
            unit.overwrite_shard(unit.layout.take(unit.full, unit.shard_rank))  # the master := the compute values
            if kept is not None:
                with torch.no_grad():
                    same = unit.master == kept.to(unit.shard.dtype).to(kept.dtype)
                    unit.master.copy_(torch.where(same, kept, unit.master))


@dataclass(frozen=True)
class _WholeModel:
    """What `gather_begin` holds besides the units when it pinned all of them: the suspended trace."""

    saved: Any
