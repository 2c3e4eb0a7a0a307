"""`deepspeed.utils.bwc`: read the tensor- and pipeline-parallel answers of an `mpu` of any generation.

The model-parallel unit scripts pass (`initialize(mpu=...)`, `deepspeed.utils.groups.mpu`) has been spelt three ways
over Megatron-LM's and DeepSpeed's history: `get_tensor_model_parallel_*` (Megatron-LM and DeepSpeed since their
pipeline-parallel releases), `get_slice_parallel_*` (DeepSpeed's pipeline topology in between) and
`get_model_parallel_*` (the oldest). Code that takes an mpu from a script asks through these readers, which try the
spellings newest first, so that one code path serves every mpu. No mpu means no model parallelism: one rank, rank 0,
no group.

Example:
    >>> class Old:
    ...     def get_model_parallel_world_size(self) -> int:
    ...         return 2
    >>> bwc_tensor_model_parallel_world_size(Old()), bwc_tensor_model_parallel_world_size(None)
    (2, 1)
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

_TP_RANK = ("get_tensor_model_parallel_rank", "get_slice_parallel_rank", "get_model_parallel_rank")
_TP_WORLD_SIZE = (
    "get_tensor_model_parallel_world_size",
    "get_slice_parallel_world_size",
    "get_model_parallel_world_size",
)
_TP_GROUP = ("get_tensor_model_parallel_group", "get_slice_parallel_group", "get_model_parallel_group")
# Megatron's spelling first, then DeepSpeed's PipeModelDataParallelTopology's
_PP_WORLD_SIZE = ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size")
_PP_GROUP = ("get_pipeline_model_parallel_group", "get_pipe_parallel_group")


def _method(mpu: Any, names: tuple[str, ...]) -> Any:
    """The first of `names` that `mpu` has (None when it has none)."""
    return next((getattr(mpu, name) for name in names if hasattr(mpu, name)), None)


def _ask(mpu: Any, names: tuple[str, ...]) -> Any:
    method = _method(mpu, names)
    if method is None:
        raise ValueError(f"the mpu {type(mpu).__name__} has none of {', '.join(names)}: give it one of these methods")
    return method()


def bwc_tensor_model_parallel_rank(mpu: Any = None) -> int:
    """This process's rank in the mpu's tensor-parallel group (0 without an mpu)."""
    return 0 if mpu is None else _ask(mpu, _TP_RANK)


def bwc_tensor_model_parallel_world_size(mpu: Any = None) -> int:
    """Ranks in the mpu's tensor-parallel group (1 without an mpu)."""
    return 1 if mpu is None else _ask(mpu, _TP_WORLD_SIZE)


def bwc_tensor_model_parallel_group(mpu: Any = None) -> dist.ProcessGroup | None:
    """The mpu's tensor-parallel group (None without an mpu)."""
    return None if mpu is None else _ask(mpu, _TP_GROUP)


def bwc_pipeline_parallel_world_size(mpu: Any = None) -> int:
    """Pipeline stages of the mpu: 1 without an mpu, and for an mpu with no pipeline methods (a tensor-parallel-only
    Megatron mpu has no pipeline)."""
    method = None if mpu is None else _method(mpu, _PP_WORLD_SIZE)
    return 1 if method is None else method()


def bwc_pipeline_parallel_group(mpu: Any = None) -> dist.ProcessGroup | None:
    """This process's pipeline-parallel group of the mpu (None without an mpu)."""
    return None if mpu is None else _ask(mpu, _PP_GROUP)
