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
its own groups. At stage 0 the parts are replicated over their groups: each group's first rank alone counts its part
in the norm (and the dense part's bystanders, rank 0), so the sum over the world counts every gradient once, as
DeepSpeed's MoE recipes (stage 0) need; stage 3 shards the experts' units over the same group ([Note: experts at
stage 3] in moe/stage3.py).
DeepSpeed's ZeRO 1/2 divide an expert's gradient by the expert-data-parallel size instead (`average_tensor`
in stage_1_and_2.py), which makes it `ep_size` times the gradient of the mean loss; we keep the true gradient
(the single-process reference's), which Adam barely notices but gradient clipping and SGD do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard.checkpoint.state import ShardedState
from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ConfigError
from zeroshard.moe.groups import ExpertGroups
from zeroshard.moe.layer import MoE
from zeroshard.moe.parallel_experts import ParallelExperts
from zeroshard.utils.logging import get_logger, log_rank
from zeroshard.zero.flat.bystanders import Bystanders
from zeroshard.zero.flat.split import SplitStrategy, flat_parts, split_groups
from zeroshard.zero.flat.strategy import FlatPolicy
from zeroshard.zero.stepmath import StepPolicy
from zeroshard.zero.strategy import (
    AccumulationState,
    ParamGroupSpec,
)

if TYPE_CHECKING:
    from zeroshard.moe.checkpoint import ExpertTensor

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
    if offload == "nvme":  # (cpu: [Note: experts under ZeRO] holds, each part's masters on the host)
        raise ConfigError('MoE layers with ep_size > 1 do not combine with offload_optimizer "nvme" yet; use "cpu"')
    sizes = {m.ep_size for m in layers}
    if len(sizes) > 1:
        raise ConfigError(f"MoE layers with different ep_size {sorted(sizes)} are not supported in one model")


def refuse_expert_stage3(zero: Any, model: nn.Module) -> None:
    """What stage 3 with experts of ep_size > 1 does not train with ([Note: experts at stage 3] in moe/stage3.py),
    in one line, before any work; `zero`: the config's zero_optimization block."""
    where = "MoE layers with ep_size > 1 (or expert_parallel) at zero_optimization.stage 3"
    zeropp = [
        key
        for key, on in (
            ("zero_quantized_weights", bool(zero.zero_quantized_weights)),
            ("zero_hpz_partition_size", int(zero.zero_hpz_partition_size or 1) > 1),
            ("zero_quantized_gradients", bool(zero.zero_quantized_gradients)),
            ("zero_quantized_nontrainable_weights", bool(zero.zero_quantized_nontrainable_weights)),
        )
        if on
    ]
    if zeropp:
        raise ConfigError(
            f"{where} with ZeRO++ ({', '.join(zeropp)}): not implemented (its gathers and reductions run over the "
            "whole world); remove the key"
        )
    if "nvme" in (str(zero.offload_param.device), str(zero.offload_optimizer.device)):
        raise ConfigError(f'{where} with offload to "nvme": not implemented; use "cpu" or no offload')
    if bool(zero.offload_optimizer.super_offload):
        raise ConfigError(f"{where} with offload_optimizer.super_offload: not implemented; remove the key")
    if any(p.is_meta for layer in moe_layers(model) if isinstance(layer, MoE) for p in layer.expert_parameters()):
        raise ConfigError(
            "MoE layers with ep_size > 1 at zero_optimization.stage 3 built on the meta device (zeroshard."
            "zero_init()): not implemented (each rank's experts would start alike); build the model with real weights"
        )


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
        self._hold(flat_parts(module, halves, device, accumulation))
        self._experts = experts
        if policy.stage == 0:  # replicated parts: each counted once where the squares are summed over the world
            for part in self.parts:
                if part.comm.rank != 0:
                    part._counted = [[] for _ in part.buffers]
            self.parts[1].bystanders = Bystanders([], expert_groups.edp, policy.step.prescale)  # (the dense part's)

    def _extra_norms(self) -> list[torch.Tensor]:
        # stage 0's bystanders (trainable, outside the optimizer) are whole on every rank: counted on rank 0 only
        replicated = self.parts[0].policy.stage == 0 and self.comm.rank != 0
        return [] if replicated else super()._extra_norms()

    def holders(self, param: torch.Tensor) -> Collectives:
        # an expert (frozen ones too) is held alike by its expert-data-parallel group only
        return self.parts[1].comm if id(param) in self._experts else self.parts[0].comm

    @property
    def _sharded(self) -> bool:
        return self.comm.world_size > 1

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        part = self._owner(param)
        grad = part.full_grad(param)  # scaled by the part's own post-scale: the world's is the true one
        return None if grad is None else grad * (self._grad_scale() / part._grad_scale())

    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        part = self._owner(param)
        part.set_full_grad(param, value * (part._grad_scale() / self._grad_scale()))

    # -- state ---------------------------------------------------------------------------------------------
    def consolidation_refused(self) -> str | None:
        return experts_consolidation_refused(self.module)

    def consolidated_params(
        self, dtype: torch.dtype, keep: bool = True, device: torch.device | None = None
    ) -> dict[int, torch.Tensor]:
        """AutoEP's fused experts whole: each rank's rows, whole over its expert-data-parallel group, gathered over
        the expert-parallel group in rank order ([Note: expert checkpoints]; collective)."""
        from zeroshard.moe.checkpoint import expert_keys

        dense, experts = self.parts
        out = dense.consolidated_params(dtype, keep, device)
        # every rank's rows, for the all-gathers below: on the host, and one expert tensor at a time on the device
        local = experts.consolidated_params(dtype, True, torch.device("cpu"))
        for row in expert_keys(self.module):
            value = local.pop(id(row.param), None)
            if value is None:  # a frozen expert: its parameter is all there is
                value = row.param.detach().to(dtype=dtype)
            whole = whole_expert(row, value.to(self.device))
            if keep:
                out[id(row.param)] = whole.to(device or whole.device)
        return out

    def full_state_dict(self) -> dict[str, Any]:
        """The module's state_dict with every expert of every expert-parallel rank, under its global name
        ([Note: expert checkpoints]); collective over each expert-parallel group."""
        from zeroshard.moe.checkpoint import expert_keys

        names = [row.local_key for row in expert_keys(self.module)]  # [Note: gathering calls agree first]
        self.agreement.agree("the full state dict", f"all-gather over expert-parallel groups of {names}")
        return with_every_expert(self.module, dict(self.module.state_dict()), self.device)

    def checkpoint_state(self) -> ShardedState:
        from zeroshard.moe.checkpoint import ExpertSplitState

        return ExpertSplitState(self)


def experts_consolidation_refused(module: nn.Module) -> str | None:
    """Why the whole model of `module` cannot be consolidated: `MoE` layers' experts are named per rank."""
    if any(isinstance(layer, MoE) for layer in moe_layers(module)):  # its experts' keys are per rank
        return "experts of ep_size > 1 live on their expert-parallel ranks (only this rank's would be gathered)"
    return None


def whole_expert(row: ExpertTensor, value: torch.Tensor) -> torch.Tensor:
    """AutoEP's fused `row` whole: this rank's `value` of it (its rows) and its expert-parallel peers', in rank
    order ([Note: expert checkpoints]; collective over the expert-parallel group)."""
    gathered = value.new_empty(row.ep.world_size * value.numel())
    row.ep.all_gather(gathered, value.reshape(-1).contiguous(), label="moe.consolidate")
    return gathered.view(row.full_shape)


def with_every_expert(module: nn.Module, state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """`module`'s state_dict `state` (this rank's experts under their local keys, each whole over its
    expert-data-parallel group) with every expert of every expert-parallel rank under its global name ([Note:
    expert checkpoints]), on the host; collective over each expert-parallel group."""
    from zeroshard.moe.checkpoint import expert_keys

    for row in expert_keys(module):
        value, count = state.pop(row.local_key), row.ep.world_size
        value = value.to(device)  # (stage 3's state is on the host already: NCCL gathers device memory)
        gathered = torch.empty(count * value.numel(), dtype=value.dtype, device=value.device)
        row.ep.all_gather(gathered, value.detach().reshape(-1).contiguous(), label="moe.full_state_dict")
        # on the host as each is gathered: all of a model's experts need not fit on the device
        if row.fused:  # rank j's rows follow rank j-1's ([Note: expert checkpoints])
            state[row.local_key] = gathered.view(row.full_shape).cpu()
            continue
        for key, part in zip(row.keys, gathered.view(count, *value.shape).cpu(), strict=True):
            state[key] = part
    return state
