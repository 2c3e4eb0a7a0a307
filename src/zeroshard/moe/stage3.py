"""ZeRO stage 3 for a model with MoE layers (ep_size > 1) or AutoEP's split experts.

[Note: experts at stage 3]
Each expert layer's experts module (AutoEP's `ParallelExperts`, a `MoE` layer's `deepspeed_moe.experts`) is a unit
of its own ([Note: units apart] in zero/stage3/plan.py), sharded over its expert-data-parallel group instead of the
world: its parameters, masters, gradients and optimizer state are split `W/ep` ways among the ranks that hold the same
experts, as DeepSpeed's stage 3 partitions AutoEP experts over their expert-data-parallel group. Every other unit is
sharded over the world as usual. An expert unit is gathered over its group when its module runs (after the tokens
were routed: every rank runs every experts module each forward, [Note: routed rows] in moe/parallel_experts.py) and
its gradients are reduce-scattered over the same group. [Note: experts under ZeRO] carries over unchanged: the
reduce-scatter sums an expert's gradient over its expert-data-parallel group, which, with the exchanges' backward,
sums it over every rank, and the world's post-scale turns it into the true gradient; the global norm all-reduces
per-rank squares over the world, where each shard of each expert is held by exactly one rank.
- Checkpoints name the experts globally ([Note: expert checkpoints] in moe/checkpoint.py): a unit's pieces move to
  their offset in the whole tensor (AutoEP) or take the expert's global index (`MoE`), so they load into stages 1-2,
  another `ep_size` or a plain model, and back.
- `save_16bit_model`, `_zero3_consolidated_16bit_state_dict` and accelerate's `get_state_dict` gather each expert
  tensor over its expert-parallel group after its unit's gather. `safe_get_full_*` give this rank's experts whole
  over their group (as at stages 1-2).
- `GatheredParameters(..., modifier_rank=r)` over an expert unit keeps, in each expert-data-parallel group, the
  values of the member in `r`'s place in its own group (rank `r` holds other experts than most groups do).
- Refused in one line: ZeRO++ (qwZ, hpZ, qgZ, quantized frozen weights: their gathers run over the world's
  partition), NVMe for parameters or optimizer state, `super_offload`, LAMB and Muon (a per-parameter plan over
  the world), `MoE` layers built on the meta device (`zero_init`: each rank's experts would start alike). AutoEP's
  experts under `zero_init` are read from the checkpoint, each rank its rows ([Note: AutoEP under zero_init]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.checkpoint.format import TensorInfo
from zeroshard.checkpoint.state import ShardedState
from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ConfigError
from zeroshard.moe.checkpoint import ExpertTensor, expert_keys, global_expert_names
from zeroshard.moe.groups import ExpertGroups
from zeroshard.moe.layer import MoE
from zeroshard.moe.zero import experts_consolidation_refused, moe_layers, whole_expert, with_every_expert
from zeroshard.optim.lamb import refuse_unplanned
from zeroshard.optim.muon import Muon
from zeroshard.zero.flat.split import split_groups
from zeroshard.zero.stage3.checkpoint import OwnedRange, Stage3State
from zeroshard.zero.stage3.strategy import Stage3Policy, Stage3Strategy
from zeroshard.zero.stage3.unit import ShardedUnit
from zeroshard.zero.strategy import AccumulationState, ParamGroupSpec, Strategy


def expert_unit_modules(module: nn.Module) -> dict[str, ExpertGroups]:
    """The qualified names of the modules whose parameters are experts (AutoEP's split experts, `MoE` layers'
    `deepspeed_moe.experts`) and their layer's groups ([Note: experts at stage 3])."""
    names = {id(m): n for n, m in module.named_modules()}
    out = {}
    for layer in moe_layers(module):
        if layer.ep_size > 1:
            out[names[id(layer.deepspeed_moe.experts if isinstance(layer, MoE) else layer)]] = layer.groups
    return out


class ExpertStage3Strategy(Stage3Strategy):
    """[Note: experts at stage 3] stage 3 with the experts' units over their expert-data-parallel group."""

    regroups = True  # the experts' optimizer groups follow the others', as at stages 1-2

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroupSpec],
        policy: Stage3Policy,
        comm: Collectives,
        device: torch.device,
        accumulation: AccumulationState,
    ):
        self._apart = expert_unit_modules(module)  # each layer's own groups
        policy = dataclasses.replace(
            policy,
            leaves=dataclasses.replace(policy.leaves, apart=frozenset(self._apart)),
            unit_groups={name: layer_groups.edp for name, layer_groups in self._apart.items()},
        )
        # the experts in optimizer groups of their own after the others', as stages 1-2 keep them (a checkpoint's
        # per-group state, e.g. a scheduler's learning rates, then loads across the stages)
        experts = {id(p) for layer in moe_layers(module) for p in layer.expert_parameters()}
        dense_groups, expert_param_groups = split_groups(groups, experts)
        super().__init__(module, dense_groups + expert_param_groups, policy, comm, device, accumulation)
        self._experts = {id(row.param): row for row in expert_keys(module)}

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        refuse_unplanned(optimizer, "MoE experts at stage 3")
        if isinstance(optimizer, Muon):  # (a config's "Muon" is refused at initialize: optim/regroup.py)
            raise ConfigError(
                "Muon is not supported with MoE experts at stage 3: its matrix exchange runs over the whole world, "
                "not the experts' groups; use AdamW"
            )
        super().attach(optimizer)

    def modifier_in(self, unit: ShardedUnit, modifier_rank: int) -> int:
        if unit.comm is self.comm:
            return modifier_rank
        mesh = self._apart[unit.name].mesh
        return unit.comm.global_rank(mesh.edp_rank(modifier_rank))

    # -- the whole model ---------------------------------------------------------------------------------
    def consolidation_refused(self) -> str | None:
        return experts_consolidation_refused(self.module)

    def consolidated_value(
        self,
        param: nn.Parameter,
        value: torch.Tensor,
        out: dict[int, torch.Tensor] | None,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        row = self._experts.get(id(param))
        if row is None:
            super().consolidated_value(param, value, out, dtype, device)
            return
        whole = whole_expert(row, value.to(dtype))  # every rank of the expert-parallel group takes part
        if out is not None:
            out[id(param)] = whole.to(device or self.device, copy=True)

    def full_state_dict(self) -> dict[str, Any]:
        return with_every_expert(self.module, super().full_state_dict(), self.device)

    def save_state_dict(self, keep: bool) -> dict[str, Any]:
        return Strategy.save_state_dict(self, keep)  # every rank gathers its experts for the others

    def whole_state_dict(self, exclude_frozen: bool) -> dict[str, Any] | None:
        if experts_consolidation_refused(self.module) is None:  # AutoEP's experts: consolidated_params names them
            return None
        frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
        frozen |= {key for row in self._experts.values() if not row.param.requires_grad for key in row.keys}
        whole = self.full_state_dict()
        return {k: v.detach().to("cpu", copy=True) for k, v in whole.items() if not (exclude_frozen and k in frozen)}

    def checkpoint_state(self) -> ShardedState:
        return ExpertStage3State(self, list(self._experts.values()))


class ExpertStage3State(Stage3State):
    """`ShardedState` of `ExpertStage3Strategy`: stage 3's pieces, experts under their global names at their
    offsets in the whole tensor ([Note: expert checkpoints])."""

    def __init__(self, strategy: ExpertStage3Strategy, experts: list[ExpertTensor]):
        super().__init__(strategy)
        self.renamed, self.peers = global_expert_names(strategy.module)
        self.offsets = {row.local_key: row.offset for row in experts}
        self.shapes = {id(row.param): row.full_shape for row in experts}

    def _owned(self, units: Any = None) -> list[OwnedRange]:
        moved = []
        for o in super()._owned(units):
            at = self.offsets.get(o.name, 0)
            name = self.renamed.get(o.name, o.name)
            moved.append(dataclasses.replace(o, name=name, begin=o.begin + at, end=o.end + at))
        return moved

    def sharded_params(self) -> dict[int, str]:
        return {ident: self.renamed.get(name, name) for ident, name in super().sharded_params().items()}

    def peer_tensors(self) -> dict[str, TensorInfo]:
        return self.peers

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return {**super().full_shapes(), **self.shapes}
