"""`initialize(mpu=...)`: the groups of a Megatron-style model-parallel unit.

[Note: mpu groups]
DeepSpeed accepts an `mpu` object with `get_model_parallel_rank/world_size/group` and
`get_data_parallel_rank/world_size/group` (Megatron's `parallel_state` has them). Its model is already split by the
caller (Megatron layers or DTensor plans), so zeroshard applies no plan: ZeRO reduces and shards over the mpu's
data-parallel group, and the gradient norm is summed over its model-parallel group, counting the parameters that
are sliced across it (DTensor Shard placements, or Megatron's `tensor_model_parallel` attribute) as they are and
the others once ([Note: tensor-parallel norm]). Initial weights are broadcast within the data-parallel group from
its first rank, as DeepSpeed's engine does with an mpu.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zeroshard.comm.collectives import Collectives, scope_of
from zeroshard.comm.topology import NodeLayout
from zeroshard.errors import ConfigError
from zeroshard.tp.mesh import TensorParallelContext

METHODS = (
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_model_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_data_parallel_group",
)


def check_mpu(mpu: Any) -> None:
    missing = [m for m in METHODS if not callable(getattr(mpu, m, None))]
    if missing:
        raise ConfigError(
            f"initialize(mpu=...): the object lacks {missing}; pass an object with DeepSpeed's mpu methods "
            f"{list(METHODS)} (Megatron's parallel_state has them)"
        )


def context_from_mpu(mpu: Any, world: Collectives, stages: int = 1) -> TensorParallelContext:
    """[Note: mpu groups] this rank's collectives over the mpu's groups (counted in `world`'s counters);
    `stages` pipeline stages beside them with a PipelineModule ([Note: 3D mesh] in pipe/three_d.py)."""
    check_mpu(mpu)
    tp, dp = int(mpu.get_model_parallel_world_size()), int(mpu.get_data_parallel_world_size())
    if tp * dp * stages != world.world_size:
        raise ConfigError(
            f"initialize(mpu=...): model-parallel size {tp} x data-parallel size {dp} x pipeline stages {stages} "
            f"!= world size {world.world_size}; pass an mpu whose sizes multiply (with the PipelineModule's "
            "num_stages) to the world size"
        )
    dp_group, tp_group = mpu.get_data_parallel_group(), mpu.get_model_parallel_group()
    nodes = NodeLayout.from_env(world.world_size)
    dp_ranks, tp_ranks = dist.get_process_group_ranks(dp_group), dist.get_process_group_ranks(tp_group)
    dp_comm = world.subgroup(dp_group, dp, int(mpu.get_data_parallel_rank()), scope_of(nodes, dp_ranks))
    tp_comm = world.subgroup(tp_group, tp, int(mpu.get_model_parallel_rank()), scope_of(nodes, tp_ranks))
    return TensorParallelContext(None, dp_comm, tp_comm, dp_ranks[0])
