"""`deepspeed.runtime.utils`: `see_memory_usage`, `set_random_seed` and `move_to_device`."""

from __future__ import annotations

import gc
import logging
import random
from collections.abc import Callable
from typing import Any

import torch

from zeroshard.accelerator import get_accelerator
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
