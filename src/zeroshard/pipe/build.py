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
from zeroshard.moe.layer import refuse_pipeline_experts
from zeroshard.moe.zero import moe_layers
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
    _refuse_experts(model, world, device)
    schedule, virtual = pipeline_schedule(cfg.pipeline, model)
    model.interleave(virtual)  # before the groups: which stages hold a tied key depends on the chunks
    return PipeContext.create(world, model, schedule)


def _refuse_experts(model: PipelineModule, world: Collectives, device: torch.device) -> None:
    """MoE layers built outside the PipelineModule (on every rank, so their groups exist) are held by their stage
    only: that stage's ranks find them and every rank refuses, none waits in a group's creation. Collective."""
    try:
        for layer in moe_layers(model):
            refuse_pipeline_experts(layer.ep_size, model.num_stages)
        refused = None
    except ConfigError as e:
        refused = e
    if world.any_true(refused is not None, device):
        raise refused or ConfigError(
            "MoE(ep_size > 1) in a PipelineModule of several stages (on another stage): expert parallelism with "
            "pipeline parallelism (pp x ep) is not implemented; use ep_size=1 in a pipeline"
        )


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
