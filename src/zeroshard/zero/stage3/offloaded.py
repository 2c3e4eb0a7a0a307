"""Stage 3's side of `engine.offload_states()` ([Note: offloaded states] in offload/states.py). A mixin of
`Stage3Strategy`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zeroshard.zero.pool import BufferPool
from zeroshard.zero.stage3.ds_param import ZeroParamStatus, show
from zeroshard.zero.stage3.schedule import GatherSchedule
from zeroshard.zero.stage3.unit import ShardedUnit
from zeroshard.zero.strategy import optimizer_state_tensors


class Stage3Offload:
    """What each kind of state is at stage 3, and the parameters' view of it while it is away."""

    units: list[ShardedUnit]
    schedule: GatherSchedule
    pool: BufferPool
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    _ds_tensors: dict[nn.Parameter, torch.Tensor]  # offload_states(lp_params): each parameter's part, kept

    def offloadable(self) -> dict[str, list[torch.Tensor]]:
        copies = [u.grad_copy for u in self.units if u.grad_copy is not None and u.grad_copy is not u.grad_shard]
        return {
            "optim_states": optimizer_state_tensors(self.optimizer),
            "hp_params": [m for u in self.units for m in u.separate_master()],
            "lp_params": [t for u in self.units for t in u.stored()] + [u.full for u in self.units if u.persistent],
            "lp_grads": [u.grad_shard for u in self.units] + copies,
        }

    def offload_refused(self, kinds: Sequence[str]) -> str | None:
        if "lp_params" in kinds and any(unit.pins for unit in self.units):
            return "inside GatheredParameters or generation (the gathered parameters are in use)"
        return None

    def show_params(self, away: bool) -> None:
        """[Note: offloaded states]: while the shards are away, gathers and forwards refuse, the persistent unit's
        parameters show placeholders and every `ds_tensor` is empty (as DeepSpeed's swapped-out ones)."""
        self.schedule.params_away = away
        for unit in self.units:
            if unit.persistent:
                status = ZeroParamStatus.NOT_AVAILABLE if away else ZeroParamStatus.AVAILABLE
                show(unit.params, unit.placeholders if away else unit.views, status)
            for param in unit.params:
                part: torch.Tensor = param.ds_tensor  # type: ignore[attr-defined]
                if away and part.device == self.device:  # (a shard offload_param keeps on the host stays)
                    self._ds_tensors[param] = part
                    param.ds_tensor = part.new_empty(0)  # type: ignore[attr-defined]
                elif not away and param in self._ds_tensors:
                    param.ds_tensor = self._ds_tensors.pop(param)  # type: ignore[attr-defined]

    def release_buffers(self) -> None:
        self.pool.clear()
