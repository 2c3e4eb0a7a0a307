"""`deepspeed.runtime.utils`: `see_memory_usage` and `set_random_seed`."""

from __future__ import annotations

import gc
import logging
import random

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
