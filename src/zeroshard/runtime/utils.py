"""`deepspeed.runtime.utils`: `see_memory_usage`, `set_random_seed`, `move_to_device`, `clip_grad_norm_`,
`get_weight_norm`, `call_to_str`, the pipeline's `partition_uniform`, `partition_balanced`, `prefix_sum_inc` and
`PartitionedTensor`, and the overflow check scripts run on their own gradients (`CheckOverflow`, overflow.py)."""

from __future__ import annotations

import gc
import itertools
import logging
import math
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from zeroshard.accelerator import get_accelerator
from zeroshard.comm import api as comm
from zeroshard.runtime.overflow import CheckOverflow, get_global_norm, is_invalid_grad_norm
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

_GIB = 1024**3


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log `message` with the accelerator's allocated/peak/reserved memory on rank 0, then reset the peak
    (DeepSpeed's behaviour); nothing unless `force`. Logged, not printed."""
    if not force:
        return
    gc.collect()  # report what is live, not what the collector has yet to free
    acc = get_accelerator()
    log_rank(
        logger,
        logging.INFO,
        f"{message} | MA {acc.memory_allocated() / _GIB:.2f} GB Max_MA {acc.max_memory_allocated() / _GIB:.2f} GB "
        f"CA {acc.memory_reserved() / _GIB:.2f} GB Max_CA {acc.max_memory_reserved() / _GIB:.2f} GB",
    )
    acc.reset_peak_memory_stats()


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, numpy (when installed) and torch, as DeepSpeed's `set_random_seed` does."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % (2**32))  # numpy accepts only 32-bit seeds
    torch.manual_seed(seed % (2**63))


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """Tensors in `item` (nested lists, tuples and dicts) on `device`, as DeepSpeed's. With `criterion_func`, a
    tensor it accepts is moved in place (its `.data` replaced) and returned; other leaves are moved as without it
    (DeepSpeed's behaviour). A leaf with a `.to` (a tensor, a tokenizer's BatchEncoding) is moved with it; any
    other leaf comes back as it is (DeepSpeed raises on it).

    Example:
        >>> batch = move_to_device({"input_ids": torch.zeros(2, 3)}, "cpu")
    """
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if hasattr(item, "to") else item


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2, mpu: Any = None
) -> torch.Tensor:
    """DeepSpeed's `clip_grad_norm_`: scale the given parameters' gradients in place by
    min(1, max_norm / (total_norm + 1e-6)) and return total_norm (a tensor on the first parameter's device).

    As DeepSpeed computes it: the `norm_type` norm of this rank's gradients (`inf`: the largest magnitude); with an
    `mpu` (Megatron's `get_model_parallel_rank()`/`get_model_parallel_group()`), summed (`inf`: the max) over its
    model-parallel group, a parameter not marked `model_parallel`/`tensor_model_parallel` counted on model-parallel
    rank 0 only; then averaged over the data-parallel group (`zeroshard.utils.groups`): the mean of the ranks'
    norms, which equals each one where the ranks hold the same gradients (DeepSpeed averages for MoE layers, whose
    expert gradients differ by rank). It is a collective over those groups once torch.distributed is initialised:
    call it on every rank. For the engine's own gradients use ds_config `gradient_clipping` (they live in the
    engine's flat buffers, not in `p.grad`).

    Example:
        >>> layer = torch.nn.Linear(4, 4)
        >>> layer(torch.ones(2, 4)).sum().backward()
        >>> norm = clip_grad_norm_(layer.parameters(), max_norm=1.0)
    """
    from zeroshard.utils import groups

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    norm_type = float(norm_type)
    device = get_accelerator().current_device_name()  # where the collectives can run (NCCL needs the device)
    mp_group = mpu.get_model_parallel_group() if mpu is not None else None
    if norm_type == math.inf:
        norms = [p.grad.detach().abs().max().float() for p in params]  # type: ignore[union-attr]
        total = torch.stack(norms).max().to(device) if norms else torch.zeros((), device=device)
        if mpu is not None:
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=mp_group)
    else:
        counted = [
            p for p in params if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)
        ]
        norms = [p.grad.detach().float().norm(norm_type) for p in counted]  # type: ignore[union-attr]
        total = torch.stack(norms).pow(norm_type).sum().to(device) if norms else torch.zeros((), device=device)
        if mpu is not None:
            comm.all_reduce(total, op=comm.ReduceOp.SUM, group=mp_group)
        total = total.pow(1.0 / norm_type)
    if comm.is_available() and comm.is_initialized():
        total = total / float(groups.get_data_parallel_world_size())
        comm.all_reduce(total, group=groups.get_data_parallel_group())
    if params:
        total = total.to(params[0].device)
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coefficient.to(p.grad.device))  # type: ignore[union-attr]
    return total


def is_model_parallel_parameter(param: torch.Tensor) -> bool:
    """DeepSpeed's: Megatron marks the parameters split across model-parallel ranks (`model_parallel`,
    `tensor_model_parallel`). zeroshard's AutoTP slices are DTensors, which carry their placements instead."""
    return bool(getattr(param, "model_parallel", False) or getattr(param, "tensor_model_parallel", False))


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """`base(arg, ..., key=value, ...)` with each value's repr, as DeepSpeed's `call_to_str`.

    Example:
        >>> call_to_str("LayerSpec", 4, bias=False)
        'LayerSpec(4, bias=False)'
    """
    arguments = [repr(arg) for arg in args] + [f"{key}={value!r}" for key, value in kwargs.items()]
    return f"{base}({', '.join(arguments)})"


def get_weight_norm(parameters: torch.Tensor | Iterable[torch.Tensor], norm_type: float = 2, mpu: Any = None) -> float:
    """DeepSpeed's `get_weight_norm`: the `norm_type` norm of the parameters' values (not their gradients), -1 when
    it is not finite. With an `mpu`, summed (`inf`: the max) over its model-parallel group, a parameter not marked
    `model_parallel` counted on model-parallel rank 0 only, and a pipeline's replicated copy
    (`ds_pipe_replicated`) once; a collective over that group then.

    Example:
        >>> get_weight_norm([torch.ones(3), torch.ones(1)])
        2.0
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    device = get_accelerator().current_device_name()
    group = mpu.get_model_parallel_group() if mpu is not None else None
    if norm_type == math.inf:
        maxima = [p.detach().abs().max().float() for p in params if p.numel()]
        total = torch.stack(maxima).max().to(device) if maxima else torch.zeros((), device=device)
        if mpu is not None:
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=group)
        value = float(total)
    else:
        counted = [
            p
            for p in params
            if not getattr(p, "ds_pipe_replicated", False)
            and (mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p))
        ]
        powers = [p.detach().float().norm(norm_type) ** norm_type for p in counted]
        total = torch.stack(powers).sum().to(device) if powers else torch.zeros((), device=device)
        if mpu is not None:
            comm.all_reduce(total, op=comm.ReduceOp.SUM, group=group)
        value = float(total) ** (1.0 / norm_type)
    return value if math.isfinite(value) else -1


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's: the stage boundaries of `num_items` equal layers over `num_parts` (pipe/partition.py)."""
    from zeroshard.pipe import partition  # (the pipe package imports this module)

    return partition.partition_uniform(num_items, num_parts)


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's: the stage boundaries that balance `weights` over `num_parts` (pipe/partition.py)."""
    from zeroshard.pipe import partition

    return partition.partition_balanced(weights, num_parts)


def prefix_sum_inc(weights: Iterable[float]) -> list[float]:
    """The inclusive prefix sums of `weights` (DeepSpeed's pipeline partitioning helper).

    Example:
        >>> prefix_sum_inc([3, 4, 5])
        [3, 7, 12]
    """
    return list(itertools.accumulate(weights))


def __getattr__(name: str) -> Any:
    if name == "PartitionedTensor":  # built on the pipe package, which imports this module
        from zeroshard.runtime.partitioned_tensor import PartitionedTensor

        return PartitionedTensor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckOverflow",
    "PartitionedTensor",  # noqa: F822 - module __getattr__ above
    "call_to_str",
    "clip_grad_norm_",
    "get_global_norm",
    "get_weight_norm",
    "is_invalid_grad_norm",
    "is_model_parallel_parameter",
    "move_to_device",
    "partition_balanced",
    "partition_uniform",
    "prefix_sum_inc",
    "see_memory_usage",
    "set_random_seed",
]
