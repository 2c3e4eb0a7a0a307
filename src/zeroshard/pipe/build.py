"""`initialize`'s pipeline path: the mesh's groups for a `PipelineModule`, and its data loader."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from zeroshard.comm.collectives import Collectives
from zeroshard.config import ZeroshardConfig
from zeroshard.errors import ConfigError
from zeroshard.moe.groups import make_stage_groups
from zeroshard.moe.zero import moe_layers, refuse_expert_settings
from zeroshard.pipe.context import PipeContext, pipeline_schedule, refuse_unsupported
from zeroshard.pipe.module import PipelineModule


def build_pipe(
    cfg: ZeroshardConfig, model: nn.Module, world: Collectives, device: torch.device, mpu: Any = None
) -> PipeContext | None:
    """None unless `model` is a PipelineModule; else its checked config and this rank's groups (every rank
    creates every group, in the same order)."""
    if not isinstance(model, PipelineModule):
        return None
    if model.model_parallel_size > 1 and mpu is None:
        raise ConfigError(
            f"PipelineModule(topology=...) with model dimension {model.model_parallel_size} needs the layers' "
            "groups: pass initialize(mpu=...) ([Note: 3D mesh] in pipe/three_d.py)"
        )
    refuse_unsupported(int(cfg.zero_optimization.stage), str(cfg.zeroshard.backend))
    schedule, virtual = pipeline_schedule(cfg.pipeline, model)
    model.interleave(virtual)  # before the groups: which stages hold a tied key depends on the chunks
    _stage_experts(model, world, device, mpu, cfg)
    return PipeContext.create(world, model, schedule)


def _stage_experts(
    model: PipelineModule, world: Collectives, device: torch.device, mpu: Any, cfg: ZeroshardConfig
) -> None:
    """[Note: expert groups in a pipeline] make the groups of the MoE layers the stages built; refuse, on every
    rank (none waits in a group's creation or in the schedule), a MoE layer built outside the module (its groups
    span the world) in a pipeline of several stages, experts with an mpu's tensor parallelism, and what experts
    do not train with (`refuse_expert_settings`): only some stages hold MoE layers. Collective."""
    refused, layers = None, moe_layers(model)
    offload = str(cfg.zero_optimization.offload_optimizer.device)
    try:
        refuse_expert_settings(layers, int(cfg.zero_optimization.stage), offload)
        if offload != "none" and any(layer.ep_size > 1 for layer in layers):  # tested without a pipeline only
            raise ConfigError("MoE layers with ep_size > 1 in a PipelineModule do not combine with offload_optimizer")
    except ConfigError as e:
        refused = e
    for layer in layers:
        if layer.ep_size > 1 and mpu is not None:
            refused = ConfigError(
                f"MoE(ep_size={layer.ep_size}) with initialize(mpu=...): tp x ep is not implemented; use ep_size=1 "
                "with an mpu, or no mpu"
            )
        elif layer.ep_size > 1 and model.num_stages > 1 and not layer.groups.staged:
            refused = ConfigError(
                f"MoE(ep_size={layer.ep_size}) built outside the PipelineModule of {model.num_stages} stages: its "
                "expert groups span the stages; give it to the PipelineModule as a LayerSpec (or inside one) so "
                "that its groups are its stage's"
            )
    if world.any_true(refused is not None, device):
        raise refused or ConfigError(
            "MoE(ep_size > 1) on another stage cannot train in this pipeline (see that rank's error: built outside "
            "the PipelineModule, with an mpu, or a setting experts do not train with)"
        )
    pending = [layer.groups for layer in layers if layer.groups.pending]
    if world.any_true(bool(pending), device):  # most pipelines have no experts: no group exchange then
        make_stage_groups(pending, world)


def pipe_dataloader(
    dataset: Any, cfg: ZeroshardConfig, pipe: PipeContext, collate_fn: Callable[..., Any] | None
) -> DataLoader[Any]:
    """DeepSpeed's pipeline loader: the replica's 1/dp of the data in order (a DistributedSampler without
    shuffling), one micro-batch at a time; the engine wraps it in a RepeatingLoader. The tensor-parallel ranks of
    a replica read the same data ([Note: 3D mesh])."""
    from zeroshard.checkpoint.sampler import ResumableDistributedSampler

    sampler = ResumableDistributedSampler(
        dataset,
        num_replicas=pipe.data_parallel_size,
        rank=pipe.data_parallel_rank,
        shuffle=False,
        drop_last=bool(cfg.dataloader_drop_last),
    )
    batch = int(cfg.train_micro_batch_size_per_gpu or 1)
    return DataLoader(
        dataset, batch_size=batch, sampler=sampler, collate_fn=collate_fn, drop_last=bool(cfg.dataloader_drop_last)
    )
