"""One parameter's values at stage 3: whole (DeepSpeed's `safe_get_full_*` / `safe_set_full_*`, collectives over the
unit's ranks: [Note: parameter registry]) and this rank's part (`safe_get_local_*` / `safe_set_local_*`). As in
DeepSpeed a frozen parameter has no fp32 master, gradient or optimizer state: the getters give None.

[Note: local values]
DeepSpeed's local API reads and writes a ZeRO-3 parameter's partition on this rank, with no collective: the fp32
master, the fp32 gradient, an optimizer state. Here a parameter's part on a rank is its range in the unit's shard (what
`ds_tensor` views while the shard is resident and not quantized): one range, empty where the rank holds none of it;
the parts of the ranks that shard the unit (the world; an expert unit's expert-data-parallel group), in their order,
are the whole flat parameter. The getters return 1-D fp32 copies of that range on the compute device (DeepSpeed returns
views of its flat fp32 buffers; here the master may live on the host or NVMe between steps, so a view could go stale),
with only the parameter's sub-group made resident; the setters write a tensor of the same length into the master (the
compute values follow from it at the next step, as DeepSpeed's) or into the optimizer state. As in DeepSpeed a frozen
parameter has none of them: the getters give None and the setters refuse. The gradient is the reduced one, unscaled,
as `safe_get_full_grad` reads it (between the boundary's backward and `step()`). The setters are refused
between the boundary's backward and the step with super_offload (the step has run: [Note: speculative host steps]). The
gradient setters (the local one and `safe_set_full_grad`'s) write where the step reads: [Note: setting a gradient] in
offload/gradients.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.errors import ZeroshardError
from zeroshard.offload.gradients import GradShard
from zeroshard.zero.stage3.sections import write_slot

if TYPE_CHECKING:
    from zeroshard.offload.gradients import GradientTier
    from zeroshard.zero.stage3.unit import ShardedUnit


class Stage3ParamValues:
    """Mixed into `Stage3Strategy`: one parameter's whole values and [Note: local values]."""

    if TYPE_CHECKING:
        optimizer: torch.optim.Optimizer | None
        device: torch.device
        stepper: Any  # SubGroupStepper
        gradients_tier: GradientTier
        speculation: Any  # Speculation | None

        agreement: Any  # GatheringAgreement

        def _slot_of(self, param: torch.Tensor) -> tuple[ShardedUnit, int, Any]: ...

        def _agree_slot(self, call: str, param: torch.Tensor, what: str) -> None: ...

        def _gather_slot(
            self, param: torch.Tensor, local: Callable[[ShardedUnit], torch.Tensor], call: str = "", what: str = ""
        ) -> torch.Tensor: ...

        def _has_state(self, key: str) -> bool: ...

        def _state_of(self, master: torch.Tensor, key: str) -> torch.Tensor: ...

        def _grad_scale(self) -> float: ...

        def optimizer_state_resident(self) -> AbstractContextManager[None]: ...

        def gather_begin(
            self, params: Sequence[torch.Tensor], call: str = "", modifier_rank: int | None = None
        ) -> list[Any]: ...

        def gather_end(self, held: list[Any], modifier_rank: int | None) -> None: ...

        def write_back(self, unit: ShardedUnit) -> None: ...

        def _pieces_of(self, unit: ShardedUnit) -> list[Any]: ...

        def _unscaled(
            self, value: torch.Tensor, numel: int, dtype: torch.dtype, call: str = "safe_set_full_grad"
        ) -> torch.Tensor: ...

    # -- one parameter's full values ([Note: parameter registry]) -------------------------------------------
    def full_fp32_param(self, param: torch.Tensor) -> torch.Tensor | None:
        if not param.requires_grad:
            return None
        with self.optimizer_state_resident():
            return self._gather_slot(param, lambda unit: unit.fp32_shard(), "safe_get_full_fp32_param", "fp32 master")

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        if not param.requires_grad:
            return None
        return self._gather_slot(param, self._grad_fp32_shard, "safe_get_full_grad", "gradient")

    def _grad_fp32_shard(self, unit: ShardedUnit) -> torch.Tensor:
        """This rank's reduced gradient shard of `unit`, unscaled, in fp32 on the compute device."""
        scale = self._grad_scale()
        if unit.grad_in_copy:  # read where it is: the shard stays released (the fp32 copy is exact)
            self.gradients_tier.landed()
            assert unit.grad_copy is not None
            if self.speculation is not None and self.speculation.scaled(unit):  # by the step, in place
                return unit.grad_copy.to(self.device, torch.float32)
            return unit.grad_copy.to(self.device, torch.float32) * scale  # (bf16 masters: a bf16 copy)
        # NVMe: read in for this, then freed again (a zero shard is made in memory, not read: it stays)
        away = not unit.grad_zero and not unit.grad_home.is_resident(unit.grad_key)
        unit.grad_resident()
        unit.grad_home.ready(unit.grad_key)
        out = unit.grad_shard.float() * scale
        if away:
            unit.grad_home.drop(unit.grad_key)
        return out

    def full_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        if not param.requires_grad:
            return None
        # `_has_state` is itself a collective: agreed with the gather that follows it
        self._agree_slot("safe_get_full_optimizer_state", param, f"optimizer state {key!r} (after a check for it)")
        if not self._has_state(key):
            return None

        def local(unit: ShardedUnit) -> torch.Tensor:
            out = torch.zeros(unit.layout.shard_numel, dtype=torch.float32, device=self.device)
            for piece in self._pieces_of(unit):
                out.narrow(0, piece.offset, piece.master.numel()).copy_(self._state_of(piece.master, key))
            return out

        with self.optimizer_state_resident():
            return self._gather_slot(param, local)  # agreed above

    def set_full_fp32_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        if param.requires_grad:
            self._unspeculated("safe_set_full_fp32_param")
        held = self.gather_begin([param], "safe_set_full_fp32_param")
        unit, index, slot = self._slot_of(param)
        with torch.no_grad():
            unit.views[index].copy_(value)
        self.write_back(unit)  # the shards := the gathered values (compute dtype)
        if unit.master is not unit.shard and param.requires_grad:  # the master gets the fp32 value (a frozen one:
            with self.optimizer_state_resident():  # the compute values write_back gave it, as elsewhere)
                write_slot(unit.layout, unit.shard_rank, slot, value, unit.master)
        self.gather_end(held, None)

    def set_full_optimizer_state(self, param: torch.Tensor, value: torch.Tensor, key: str) -> None:
        self._unspeculated("safe_set_full_optimizer_state")
        unit, _, slot = self._slot_of(param)
        with self.optimizer_state_resident():
            for piece in self._pieces_of(unit):
                state = self._state_of(piece.master, key)
                whole = torch.zeros(unit.layout.shard_numel, dtype=state.dtype, device=state.device)
                whole.narrow(0, piece.offset, piece.master.numel()).copy_(state)
                write_slot(unit.layout, unit.shard_rank, slot, value, whole)
                state.copy_(whole.narrow(0, piece.offset, piece.master.numel()))

    # -- this rank's part ([Note: local values]) ---------------------------------------------------------
    def local_range(self, param: torch.Tensor) -> tuple[ShardedUnit, int, int]:
        """`param`'s unit, and where its part starts in this rank's shard and how long it is (0: none here)."""
        unit, _, slot = self._slot_of(param)
        owned = unit.layout.owned_parts(unit.shard_rank, slot.offset, slot.offset + slot.numel)
        if not owned:
            return unit, 0, 0
        begin, end, at = owned[0]  # a parameter lies in one section: one range
        return unit, at, end - begin

    def local_fp32_param(self, param: torch.Tensor) -> torch.Tensor | None:
        if not param.requires_grad or self.optimizer is None:
            return None
        unit, at, numel = self.local_range(param)
        with self._resident(unit, changes=False):
            return unit.fp32_shard().narrow(0, at, numel).to(self.device, torch.float32, copy=True)

    def local_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        if not param.requires_grad or self.optimizer is None:
            return None
        unit, at, numel = self.local_range(param)
        return self._grad_fp32_shard(unit).narrow(0, at, numel).to(self.device, torch.float32, copy=True)

    def local_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        """None before the optimizer made `key` (its first step, on every rank alike), or for a frozen parameter."""
        if not param.requires_grad or self.optimizer is None:
            return None
        made = next((state[key] for state in self.optimizer.state.values() if key in state), None)
        if made is None:
            return None
        if not isinstance(made, torch.Tensor) or made.dim() == 0:  # refused on every rank, whatever part it holds
            self._state(None, key, "safe_get_local_optimizer_state", made)
        unit, at, numel = self.local_range(param)
        out = torch.zeros(numel, dtype=torch.float32, device=self.device)
        with self._resident(unit, changes=False):
            for piece, lo, hi in self._overlaps(unit, at, numel):
                state = self._state(piece, key, "safe_get_local_optimizer_state")
                out.narrow(0, lo - at, hi - lo).copy_(state.narrow(0, lo - piece.offset, hi - lo))
        return out

    def set_local_fp32_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        unit, at, numel = self._settable(param, value, "safe_set_local_fp32_param")
        with self._resident(unit, changes=True), torch.no_grad():
            unit.master.narrow(0, at, numel).copy_(value.reshape(-1))

    def set_local_optimizer_state(self, param: torch.Tensor, value: torch.Tensor, key: str) -> None:
        unit, at, numel = self._settable(param, value, "safe_set_local_optimizer_state")
        flat = value.reshape(-1)
        with self._resident(unit, changes=True), torch.no_grad():
            for piece, lo, hi in self._overlaps(unit, at, numel):
                state = self._state(piece, key, "safe_set_local_optimizer_state")
                state.narrow(0, lo - piece.offset, hi - lo).copy_(flat.narrow(0, lo - at, hi - lo))

    # -- gradients: [Note: setting a gradient] in offload/gradients.py ------------------------------------------
    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        if not param.requires_grad or self.optimizer is None:
            return  # nothing to set, as DeepSpeed
        self._unspeculated("safe_set_full_grad")
        unit, _, slot = self._slot_of(param)
        if not unit.layout.owned_parts(unit.shard_rank, slot.offset, slot.offset + slot.numel):
            return  # this rank holds none of it
        value = self._unscaled(value, slot.numel, unit.grad_shard.dtype)
        with self._grad_target(unit) as target:
            write_slot(unit.layout, unit.shard_rank, slot, value, target)

    def set_local_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        if not param.requires_grad or self.optimizer is None:
            return
        unit, at, numel = self._settable(param, value, "safe_set_local_grad")
        value = self._unscaled(value, numel, unit.grad_shard.dtype, "safe_set_local_grad")
        with self._grad_target(unit) as target:
            target.narrow(0, at, numel).copy_(value.reshape(-1))

    @contextmanager
    def _grad_target(self, unit: ShardedUnit) -> Iterator[torch.Tensor]:
        """What the step reads `unit`'s gradient shard from, for the block to write: the host copy the shard was
        released into, else the shard itself (resident); then the norm's record and the copy follow."""
        if unit.grad_in_copy:  # the shard stays released; the step reads the copy (still `grad_copy_ready`)
            assert unit.grad_copy is not None
            self.gradients_tier.landed()
            with torch.no_grad():
                yield unit.grad_copy
            values = unit.grad_copy.to(self.device)
            self.gradients_tier.rewritten(GradShard(unit.grad_key, values, bool(unit.trainable)))
            return
        unit.grad_resident()
        unit.grad_home.ready(unit.grad_key)
        with torch.no_grad():
            yield unit.grad_shard
        if unit.grad_copy is not None and unit.grad_copy is not unit.grad_shard:
            unit.grad_copy_ready = False  # the step copies the shard again
        self.gradients_tier.rewritten(GradShard(unit.grad_key, unit.grad_shard, bool(unit.trainable)))
        if self.gradients_tier.holds_shards:  # NVMe: back to its swap file
            unit.grad_home.evict(unit.grad_key)
            unit.grad_home.settle(unit.grad_key)

    def _unspeculated(self, call: str) -> None:
        if self.speculation is not None:
            self.speculation.check_unchanged(call)

    def _settable(self, param: torch.Tensor, value: torch.Tensor, call: str) -> tuple[ShardedUnit, int, int]:
        if not param.requires_grad or self.optimizer is None:
            raise ZeroshardError(f"{call}: the parameter is frozen (or the engine has no optimizer): no master to set")
        self._unspeculated(call)
        unit, at, numel = self.local_range(param)
        if value.numel() != numel:
            raise ZeroshardError(
                f"{call}: {value.numel()} values for this rank's part of {numel} (its length: the local getter's)"
            )
        return unit, at, numel

    def _state(self, piece: Any, key: str, call: str, value: Any = None) -> torch.Tensor:
        if piece is not None:
            value = (self.optimizer.state.get(piece.master, {}) if self.optimizer is not None else {}).get(key)
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            what = "does not exist yet (the optimizer makes it at its first step)" if value is None else "is a scalar"
            raise ZeroshardError(
                f"{call}: optimizer state {key!r} {what}; the per-element states have parts (read scalars with "
                "safe_get_full_optimizer_state)"
            )
        return value

    def _resident(self, unit: ShardedUnit, changes: bool) -> AbstractContextManager[None]:
        """Only `unit`'s sub-group in memory (NVMe offload: read in, and written back when a setter `changes` it)."""
        resident: AbstractContextManager[None] = self.stepper.resident(self.stepper.sub_group_of(unit), changes)
        return resident

    def _overlaps(self, unit: ShardedUnit, at: int, numel: int) -> list[tuple[Any, int, int]]:
        """The optimizer pieces over [at, at + numel) of the unit's shard, each with the range they share."""
        out = []
        for piece in self._pieces_of(unit):
            lo, hi = max(at, piece.offset), min(at + numel, piece.offset + piece.master.numel())
            if lo < hi:
                out.append((piece, lo, hi))
        return out
