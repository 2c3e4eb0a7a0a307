"""Learning-rate schedules from ds_config `scheduler.type` / `scheduler.params`.

The five DeepSpeed schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) are
re-implemented with DeepSpeed 0.19's formulas, parameter names and defaults, and its call convention: the
constructor writes the lr of iteration `last_batch_iteration` (-1: before the first step) into every param
group, each `step()` advances one batch and writes the new lr, and the state is `last_batch_iteration`.
Each schedule's parameters are a frozen dataclass, so one schema documents, defaults and validates them.
Any `torch.optim.lr_scheduler` class is also accepted by name, its params passed as keyword arguments.

One module per concept: `base` (the batch-iteration convention), `warmup` (the three warmup schedules),
`one_cycle`, `range_test`, `factory` (names to schedulers), `checks` (parameter validation).
"""

from zeroshard.optim.schedulers.base import BatchLRScheduler, LRSchedulerLike
from zeroshard.optim.schedulers.checks import PerGroup
from zeroshard.optim.schedulers.factory import build_lr_scheduler, supported_scheduler_names
from zeroshard.optim.schedulers.one_cycle import OneCycle, OneCycleParams
from zeroshard.optim.schedulers.range_test import LRRangeTest, LRRangeTestParams
from zeroshard.optim.schedulers.warmup import (
    LINEAR_WARMUP,
    LOG_WARMUP,
    WarmupCosineLR,
    WarmupCosineLRParams,
    WarmupDecayLR,
    WarmupDecayLRParams,
    WarmupLR,
    WarmupLRParams,
)

__all__ = [
    "BatchLRScheduler",
    "LINEAR_WARMUP",
    "LOG_WARMUP",
    "LRRangeTest",
    "LRRangeTestParams",
    "LRSchedulerLike",
    "OneCycle",
    "OneCycleParams",
    "PerGroup",
    "WarmupCosineLR",
    "WarmupCosineLRParams",
    "WarmupDecayLR",
    "WarmupDecayLRParams",
    "WarmupLR",
    "WarmupLRParams",
    "build_lr_scheduler",
    "supported_scheduler_names",
]
