"""ZeRO stages 1/2 for a model with MoE layers: non-expert parameters over all ranks, experts over their own
expert-data-parallel group.

[Note: experts under ZeRO]
An expert's gradient on one rank already sums the losses of its whole expert-parallel group (the exchange's
backward brings them); summing it over the expert-data-parallel group therefore sums over every rank, and the
same post-scale as the other parameters (the mean over all `W` ranks) gives the true gradient of the global
batch's mean loss. So the model splits into two `FlatStrategy`s sharing one optimizer: the non-expert part over
the world, the expert part over the expert-data-parallel group (its master weights, gradients and optimizer
state sharded `W/ep` ways, as DeepSpeed's ZeRO 1/2 shards them). The step is the common skeleton: one global
norm (each shard counts once when the per-rank squares are summed over the world: the world's ranks hold
disjoint shards of the non-expert buffer, and of each expert group's buffer), one scale, then each part steps
its own groups. Stage 0 (replicated copies would be counted more than once) and stage 3 are refused.
DeepSpeed's ZeRO 1/2 divide an expert's gradient by the expert-data-parallel size instead (`average_tensor`
in stage_1_and_2.py), which makes it `ep_size` times the gradient of the mean loss; we keep the true gradient
(the single-process reference's), which Adam barely notices but gradient clipping and SGD do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.checkpoint.state import ShardedState
from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ConfigError
from zeroshard.moe.groups import ExpertGroups
from zeroshard.moe.layer import MoE
from zeroshard.moe.parallel_experts import ParallelExperts
from zeroshard.utils.logging import get_logger, log_rank
from zeroshard.zero.flat.split import SplitStrategy, flat_parts, split_groups
from zeroshard.zero.flat.strategy import FlatPolicy
from zeroshard.zero.stepmath import StepPolicy
from zeroshard.zero.strategy import (
    AccumulationState,
    ParamGroupSpec,
)

logger = get_logger(__name__)


def moe_layers(module: nn.Module) -> list[MoE | ParallelExperts]:
    """The model's expert layers: `MoE` layers and AutoEP's split experts ([Note: AutoEP] in moe/auto.py)."""
    return [m for m in module.modules() if isinstance(m, (MoE, ParallelExperts))]


def expert_groups_of(module: nn.Module, stage: int, world: Collectives, offload: str = "none") -> ExpertGroups | None:
    """The expert groups of `module`'s MoE layers, counted in `world`'s counters; None without any, or when every
    layer has ep_size 1 (its experts are then ordinary data-parallel parameters, at any stage)."""
    layers = moe_layers(module)
    for layer in layers:
        layer.groups.counted_by(world)
    if all(layer.ep_size == 1 for layer in layers):
        return None
    refuse_expert_settings(layers, stage, offload)
    groups = layers[0].groups
    log_rank(
        logger,
        20,
        f"MoE: {len(layers)} layer(s), ep_size {groups.mesh.ep_size}: experts' ZeRO-{stage} state sharded over "
        f"their {groups.mesh.edp_size} expert-data-parallel ranks",
    )
    return groups


def refuse_expert_settings(layers: list[MoE | ParallelExperts], stage: int, offload: str = "none") -> None:
    """What MoE layers with ep_size > 1 do not train with, in one line (pure: the caller makes every rank agree
    where the layers differ across ranks, as a pipeline's stages do)."""
    if all(layer.ep_size == 1 for layer in layers):
        return
    if stage not in (1, 2):
        raise ConfigError(
            f"MoE layers with ep_size > 1 train with zero_optimization.stage 1 or 2 (got {stage}): stage 3 does "
            "not partition expert parameters over their expert-data-parallel group yet, and stage 0 would count "
            "replicated expert gradients more than once in the norm; use stage 1 for the same math as stage 0 "
            "(ep_size 1 trains at every stage)"
        )
    if offload == "nvme":  # (cpu: [Note: experts under ZeRO] holds, each part's masters on the host)
        raise ConfigError('MoE layers with ep_size > 1 do not combine with offload_optimizer "nvme" yet; use "cpu"')
    sizes = {m.ep_size for m in layers}
    if len(sizes) > 1:
        raise ConfigError(f"MoE layers with different ep_size {sorted(sizes)} are not supported in one model")


@dataclasses.dataclass(frozen=True)
class _WorldPrescale(StepPolicy):
    """An expert part's step policy: `prescale_gradients` divides by the world, not the group it reduces over."""

    world_size: int = 1

    def prescale(self, world_size: int) -> float:
        return super().prescale(self.world_size)


def _fields(step: StepPolicy) -> dict[str, Any]:
    """The policy's fields as they are (`dataclasses.asdict` would deep-copy a pipeline's `model_parallel`)."""
    return {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}


class ExpertSplitStrategy(SplitStrategy):
    """[Note: experts under ZeRO] a `FlatStrategy` over the world and one over the expert-data-parallel group
    ([Note: split flat strategies])."""

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroupSpec],
        policy: FlatPolicy,
        comm: Collectives,
        device: torch.device,
        accumulation: AccumulationState,
        expert_groups: ExpertGroups,
    ):
        super().__init__(module, groups, policy, comm, device, accumulation)
        experts = {id(p) for layer in moe_layers(module) for p in layer.expert_parameters()}
        dense_groups, expert_param_groups = split_groups(groups, experts)
        expert_policy = dataclasses.replace(
            policy, step=_WorldPrescale(**_fields(policy.step), world_size=comm.world_size)
        )
        halves = [(dense_groups, policy, comm), (expert_param_groups, expert_policy, expert_groups.edp)]
        self.parts = flat_parts(module, halves, device, accumulation)

    @property
    def _sharded(self) -> bool:
        return self.comm.world_size > 1

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        part = self._owner(param)
        grad = part.full_grad(param)  # scaled by the part's own post-scale: the world's is the true one
        return None if grad is None else grad * (self._grad_scale() / part._grad_scale())

    # -- state ---------------------------------------------------------------------------------------------
    def consolidation_refused(self) -> str | None:
        if any(isinstance(layer, MoE) for layer in moe_layers(self.module)):  # its experts' keys are per rank
            return "experts of ep_size > 1 live on their expert-parallel ranks (only this rank's would be gathered)"
        return None

    def consolidated_params(
        self, dtype: torch.dtype, keep: bool = True, device: torch.device | None = None
    ) -> dict[int, torch.Tensor]:
        """AutoEP's fused experts whole: each rank's rows, whole over its expert-data-parallel group, gathered over
        the expert-parallel group in rank order ([Note: expert checkpoints]; collective)."""
        from zeroshard.moe.checkpoint import expert_keys

        dense, experts = self.parts
        out = dense.consolidated_params(dtype, keep, device)
        local = experts.consolidated_params(dtype, True, None)  # every rank's rows, for the all-gather below
        for row in expert_keys(self.module):
            value = local.pop(id(row.param), None)
            if value is None:  # a frozen expert: its parameter is all there is
                value = row.param.detach().to(dtype=dtype)
            gathered = value.new_empty(row.ep.world_size * value.numel())
            row.ep.all_gather(gathered, value.reshape(-1).contiguous(), label="moe.consolidate")
            if keep:
                out[id(row.param)] = gathered.view(row.full_shape).to(device or gathered.device)
        return out

    def full_state_dict(self) -> dict[str, Any]:
        """The module's state_dict with every expert of every expert-parallel rank, under its global name
        ([Note: expert checkpoints]); collective over each expert-parallel group."""
        from zeroshard.moe.checkpoint import expert_keys

        experts = expert_keys(self.module)
        names = [row.local_key for row in experts]  # [Note: gathering calls agree first]
        self.agreement.agree("the full state dict", f"all-gather over expert-parallel groups of {names}")
        state = dict(self.module.state_dict())
        for row in experts:
            param, count = row.param, row.ep.world_size
            gathered = torch.empty(count * param.numel(), dtype=param.dtype, device=param.device)
            row.ep.all_gather(gathered, param.detach().reshape(-1), label="moe.full_state_dict")
            del state[row.local_key]
            # on the host as each is gathered: all of a model's experts need not fit on the device
            if row.fused:  # rank j's rows follow rank j-1's ([Note: expert checkpoints])
                state[row.local_key] = gathered.view(row.full_shape).cpu()
                continue
            for key, value in zip(row.keys, gathered.view(count, *param.shape).cpu(), strict=True):
                state[key] = value
        return state

    def checkpoint_state(self) -> ShardedState:
        from zeroshard.moe.checkpoint import ExpertSplitState

        return ExpertSplitState(self)
