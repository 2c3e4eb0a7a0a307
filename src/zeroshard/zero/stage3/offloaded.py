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
from zeroshard.zero.strategy import HostView, optimizer_state_tensors


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
        if any(unit.pins for unit in self.units):  # its end writes a modifier's changes into shards and masters
            return "inside GatheredParameters or generation (the gathered parameters are in use)"
        return None

    def show_params(self, away: bool, host_view: HostView | None = None) -> None:
        """[Note: offloaded states]: while the shards are away, gathers and forwards refuse, and the persistent unit's
        parameters and every `ds_tensor` are the same views of the host copies (DeepSpeed points `ds_tensor` at its
        pinned buffer); empty where a tensor has no host copy."""
        self.schedule.params_away = away
        for unit in self.units:
            if unit.persistent:
                if away:
                    hosts = [host_view(v) if host_view is not None else None for v in unit.views]
                    shown = [h if h is not None else p for h, p in zip(hosts, unit.placeholders, strict=True)]
                    show(unit.params, shown, ZeroParamStatus.AVAILABLE)
                else:
                    show(unit.params, unit.views, ZeroParamStatus.AVAILABLE)
            for param in unit.params:
                part: torch.Tensor = param.ds_tensor  # type: ignore[attr-defined]
                if away and part.device == self.device:  # (a shard offload_param keeps on the host stays)
                    self._ds_tensors[param] = part
                    host = host_view(part) if host_view is not None else None
                    param.ds_tensor = host if host is not None else part.new_empty(0)  # type: ignore[attr-defined]
                elif not away and param in self._ds_tensors:
                    param.ds_tensor = self._ds_tensors.pop(param)  # type: ignore[attr-defined]

    def release_buffers(self) -> None:
        self.pool.clear()
