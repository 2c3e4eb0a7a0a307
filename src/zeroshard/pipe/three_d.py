"""3D parallelism: a `PipelineModule` whose layers a Megatron-style `mpu` already split (pp x tp x dp).

[Note: 3D mesh]
Ranks are laid out as DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model; model fastest):
rank = stage * (dp * tp) + d * tp + t. The pipeline mesh ([Note: pipeline mesh]) treats each (d, t) pair of a
stage as one lane (its "replica", lane = d * tp + t), so its pipeline groups (one lane across the stages) are the
3D pipeline groups and its tie groups stay within one tensor-parallel position: P2P and tied weights work
unchanged. What changes: ZeRO reduces and shards over the mpu's data-parallel group (same stage and t, every d),
not over the lane group; the data loader splits the data over d only, so the tp ranks of a lane read the same
micro-batches; the clipping norm and the overflow flag are summed over the pp x tp group of ranks sharing d
(each rank's share already counts its replicated parameters 1/tp: [Note: tensor-parallel norm]); the initial
weights are broadcast over the data-parallel group from its first rank. The mpu must lay its groups out this way
(tensor-parallel ranks consecutive): `check_layout` refuses any other layout before a group is created. The
reported loss stays the mean over the lanes: every t of a lane computes the same loss. Checkpoints: [Note: 3D
checkpoints] in pipe/checkpoint.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.comm.collectives import scope_of
from zeroshard.comm.topology import NodeLayout, new_group
from zeroshard.errors import ConfigError
from zeroshard.pipe.context import PipeContext
from zeroshard.pipe.module import PipelineModule
from zeroshard.tp.mesh import TensorParallelContext

PIPE_SIZE_METHODS = ("get_pipe_parallel_world_size", "get_pipeline_model_parallel_world_size")


def expected_ranks(stages: int, world_size: int, tp: int, rank: int) -> tuple[list[int], list[int]]:
    """[Note: 3D mesh] the tensor-parallel and data-parallel group of `rank` (pure)."""
    lanes = world_size // stages
    stage, lane = divmod(rank, lanes)
    d, t = divmod(lane, tp)
    base = stage * lanes
    return [base + d * tp + i for i in range(tp)], [base + j * tp + t for j in range(lanes // tp)]


def check_layout(stages: int, world_size: int, rank: int, tp_ranks: list[int], dp_ranks: list[int]) -> None:
    """Refuse an mpu whose groups are not [Note: 3D mesh]'s (pure: the groups' global ranks)."""
    tp, dp = len(tp_ranks), len(dp_ranks)
    if stages * tp * dp != world_size:
        raise ConfigError(
            f"initialize(mpu=...) with a PipelineModule: num_stages {stages} x model-parallel size {tp} x "
            f"data-parallel size {dp} != world size {world_size}; pass an mpu built for this world and num_stages"
        )
    want_tp, want_dp = expected_ranks(stages, world_size, tp, rank)
    if sorted(tp_ranks) != want_tp or sorted(dp_ranks) != want_dp:
        raise ConfigError(
            f"initialize(mpu=...) with a PipelineModule: rank {rank}'s model-parallel group {sorted(tp_ranks)} and "
            f"data-parallel group {sorted(dp_ranks)} are not {want_tp} and {want_dp}; lay the mpu out as "
            "DeepSpeed's PipeModelDataParallelTopology (rank = stage * dp * tp + d * tp + t)"
        )


def pipeline_size(mpu: Any) -> int | None:
    """The mpu's pipeline degree where it says one (Megatron's or Megatron-DeepSpeed's method name)."""
    for name in PIPE_SIZE_METHODS:
        method = getattr(mpu, name, None)
        if callable(method):
            return int(method())
    return None


def compose(pipe: PipeContext, tp: TensorParallelContext, mpu: Any, module: nn.Module, device: torch.device) -> None:
    """[Note: 3D mesh] check the mpu against the pipeline and give `pipe` the pp x tp norm group. Collective:
    every rank, the same mpu layout."""
    assert isinstance(module, PipelineModule)
    grid, rank, world = pipe.groups.grid, pipe.world.rank, pipe.world
    stages = pipeline_size(mpu)
    if stages is not None and stages != grid.stages:
        raise ConfigError(
            f"initialize(mpu=...): the mpu's pipeline size {stages} != the PipelineModule's num_stages "
            f"{grid.stages}; build both for the same number of stages"
        )
    if module.model_parallel_size not in (1, tp.tp_size):
        raise ConfigError(
            f"PipelineModule(topology=...) has model dimension {module.model_parallel_size} but the mpu's "
            f"model-parallel size is {tp.tp_size}; build both for the same tensor-parallel size"
        )
    tp_ranks = dist.get_process_group_ranks(mpu.get_model_parallel_group())
    dp_ranks = dist.get_process_group_ranks(mpu.get_data_parallel_group())
    try:
        check_layout(grid.stages, world.world_size, rank, tp_ranks, dp_ranks)
        refused = None
    except ConfigError as e:
        refused = e
    if world.any_true(refused is not None, device):  # every rank refuses, none waits in new_group
        raise refused or ConfigError(
            "initialize(mpu=...) with a PipelineModule: another rank's mpu groups are not laid out as "
            "PipeModelDataParallelTopology (rank = stage * dp * tp + d * tp + t); see that rank's error"
        )
    size, lanes = tp.tp_size, grid.dp
    norm = None
    for d in range(lanes // size):  # every rank creates every group, in one order
        ranks = [s * lanes + d * size + t for s in range(grid.stages) for t in range(size)]
        group = new_group(ranks)
        if rank in ranks:
            norm = world.subgroup(
                group, len(ranks), ranks.index(rank), scope_of(NodeLayout.from_env(world.world_size), ranks)
            )
    assert norm is not None
    pipe.tp_size, pipe.norm_comm = size, norm
