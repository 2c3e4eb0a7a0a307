"""One parameter's values on this rank at stage 3: DeepSpeed's `safe_get_local_*` / `safe_set_local_*`.

[Note: local values]
DeepSpeed's local API reads and writes a ZeRO-3 parameter's partition on this rank, with no collective: the fp32 master,
the fp32 gradient, an optimizer state. Here a parameter's part on a rank is the range of its unit's shard that
`ds_tensor` views ([Note: DeepSpeed's parameter attributes]): one range, empty where the rank holds none of it. The
values come back as 1-D fp32 copies of that range (DeepSpeed returns views of its flat fp32 buffers; here the master may
live on NVMe between steps, so a view could go stale) and the setters write a tensor of the same length into it: the
master (the compute values follow from it at the next step, as DeepSpeed's; in fp32 the master is the compute shard, and
a forward before the step reads the new values wherever the part is not gathered already) or the optimizer state, which
may span several optimizer groups' pieces. The gradient is the reduced one, unscaled, as `safe_get_full_grad` reads it
(between the boundary's backward and `step()`). Setting a gradient is not provided (neither is the full one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zeroshard.errors import ZeroshardError

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from zeroshard.zero.stage3.unit import ShardedUnit


class Stage3LocalValues:
    """Mixed into `Stage3Strategy`: [Note: local values]."""

    if TYPE_CHECKING:
        optimizer: torch.optim.Optimizer | None

        def _slot_of(self, param: torch.Tensor) -> tuple[ShardedUnit, int, Any]: ...

        def _pieces_of(self, unit: ShardedUnit) -> list[Any]: ...

        def _grad_fp32_shard(self, unit: ShardedUnit) -> torch.Tensor: ...

        def optimizer_state_resident(self) -> AbstractContextManager[None]: ...

    def local_range(self, param: torch.Tensor) -> tuple[ShardedUnit, int, int]:
        """`param`'s unit, and where its part starts in this rank's shard and how long it is (0: none here)."""
        unit, _, slot = self._slot_of(param)
        owned = unit.layout.owned_parts(unit.shard_rank, slot.offset, slot.offset + slot.numel)
        if not owned:
            return unit, 0, 0
        begin, end, at = owned[0]  # a parameter lies in one section: one range
        return unit, at, end - begin

    def local_fp32_param(self, param: torch.Tensor) -> torch.Tensor:
        unit, at, numel = self.local_range(param)
        with self.optimizer_state_resident():
            return unit.fp32_shard().narrow(0, at, numel).clone()

    def local_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        if not param.requires_grad:
            return None
        unit, at, numel = self.local_range(param)
        return self._grad_fp32_shard(unit).narrow(0, at, numel).clone()

    def local_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        """None before the optimizer made `key` (its first step), or for a frozen parameter."""
        unit, at, numel = self.local_range(param)
        overlaps = self._overlaps(unit, at, numel)
        if numel and not overlaps:  # a frozen parameter's part: no optimizer steps it
            return None
        out = torch.zeros(numel, dtype=torch.float32, device=unit.shard.device)
        with self.optimizer_state_resident():
            for piece, lo, hi in overlaps:
                state = self.optimizer.state.get(piece.master, {}) if self.optimizer is not None else {}
                if key not in state:
                    return None
                out.narrow(0, lo - at, hi - lo).copy_(state[key].narrow(0, lo - piece.offset, hi - lo))
        return out

    def set_local_fp32_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        unit, at, numel = self._settable(param, value, "safe_set_local_fp32_param")
        with self.optimizer_state_resident(), torch.no_grad():
            if unit.master.numel() < at + numel:
                raise ZeroshardError("safe_set_local_fp32_param: the parameter is frozen (it has no master to set)")
            unit.master.narrow(0, at, numel).copy_(value.reshape(-1))

    def set_local_optimizer_state(self, param: torch.Tensor, value: torch.Tensor, key: str) -> None:
        unit, at, numel = self._settable(param, value, "safe_set_local_optimizer_state")
        flat = value.reshape(-1)
        with self.optimizer_state_resident(), torch.no_grad():
            for piece, lo, hi in self._overlaps(unit, at, numel):
                state = self.optimizer.state.get(piece.master, {}) if self.optimizer is not None else {}
                if key not in state:
                    raise ZeroshardError(
                        f"safe_set_local_optimizer_state: optimizer state {key!r} does not exist (yet): the optimizer "
                        "creates it at its first step"
                    )
                state[key].narrow(0, lo - piece.offset, hi - lo).copy_(flat.narrow(0, lo - at, hi - lo))

    def _settable(self, param: torch.Tensor, value: torch.Tensor, call: str) -> tuple[ShardedUnit, int, int]:
        unit, at, numel = self.local_range(param)
        if value.numel() != numel:
            raise ZeroshardError(
                f"{call}: {value.numel()} values for this rank's part of {numel} (its length: the local getter's)"
            )
        return unit, at, numel

    def _overlaps(self, unit: ShardedUnit, at: int, numel: int) -> list[tuple[Any, int, int]]:
        """The optimizer pieces over [at, at + numel) of the unit's shard, each with the range they share."""
        out = []
        for piece in self._pieces_of(unit):
            lo, hi = max(at, piece.offset), min(at + numel, piece.offset + piece.master.numel())
            if lo < hi:
                out.append((piece, lo, hi))
        return out
