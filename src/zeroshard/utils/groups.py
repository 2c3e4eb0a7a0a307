"""`deepspeed.utils.groups`: the process groups scripts ask for, over zeroshard's one data-parallel group.

These are the groups of pure data parallelism: the data-parallel group is the whole world and every
model-parallel group has one rank. They do not follow an engine's meshes under tensor, pipeline or expert
parallelism (DeepSpeed keeps those in module globals that its engine fills; zeroshard keeps them on the engine:
`engine.dp_world_size`, `engine.pipe`, the mpu given to `initialize`).
"""

from __future__ import annotations

import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_data_parallel_group() -> dist.ProcessGroup | None:
    """The data-parallel group: the world group (None before torch.distributed is initialised)."""
    return dist.group.WORLD if _initialized() else None  # type: ignore[return-value]


def get_data_parallel_world_size() -> int:
    """Ranks in the data-parallel group (1 before torch.distributed is initialised)."""
    return dist.get_world_size() if _initialized() else 1


def get_data_parallel_rank() -> int:
    """This process's rank in the data-parallel group (0 before torch.distributed is initialised)."""
    return dist.get_rank() if _initialized() else 0


def get_model_parallel_world_size() -> int:
    """1: zeroshard has no model parallelism yet."""
    return 1


def get_model_parallel_rank() -> int:
    """0: zeroshard has no model parallelism yet."""
    return 0


# DeepSpeed's underscored spellings, which its own examples and tests call.
_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
_get_model_parallel_world_size = get_model_parallel_world_size
_get_sequence_parallel_world_size = get_model_parallel_world_size
_get_sequence_parallel_rank = get_model_parallel_rank
_get_expert_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank
