"""`deepspeed.runtime.lr_schedules`: DeepSpeed's five schedules under their names, built by
`optim.build_lr_scheduler` (one implementation: the one ds_config `scheduler` uses).

They take the optimizer and DeepSpeed's parameters as keywords, e.g.
`WarmupLR(optimizer, warmup_min_lr=0, warmup_max_lr=1e-3, warmup_num_steps=100)`; the result is
zeroshard's scheduler of that name (validated as ds_config's `scheduler.params` are).
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.optim.schedulers import LRSchedulerLike, build_lr_scheduler

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]


def WarmupLR(optimizer: torch.optim.Optimizer, **params: Any) -> LRSchedulerLike:  # noqa: N802
    """DeepSpeed's WarmupLR(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, ...).

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        >>> sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
        >>> opt.param_groups[0]["lr"]
        0.0
    """
    return build_lr_scheduler(WARMUP_LR, params, optimizer)


def WarmupDecayLR(optimizer: torch.optim.Optimizer, **params: Any) -> LRSchedulerLike:  # noqa: N802
    """DeepSpeed's WarmupDecayLR(optimizer, total_num_steps, warmup_min_lr, warmup_max_lr, ...)."""
    return build_lr_scheduler(WARMUP_DECAY_LR, params, optimizer)


def WarmupCosineLR(optimizer: torch.optim.Optimizer, **params: Any) -> LRSchedulerLike:  # noqa: N802
    """DeepSpeed's WarmupCosineLR(optimizer, total_num_steps, warmup_min_ratio, warmup_num_steps, ...)."""
    return build_lr_scheduler(WARMUP_COSINE_LR, params, optimizer)


def OneCycle(optimizer: torch.optim.Optimizer, **params: Any) -> LRSchedulerLike:  # noqa: N802
    """DeepSpeed's OneCycle(optimizer, cycle_min_lr, cycle_max_lr, ...)."""
    return build_lr_scheduler(ONE_CYCLE, params, optimizer)


def LRRangeTest(optimizer: torch.optim.Optimizer, **params: Any) -> LRSchedulerLike:  # noqa: N802
    """DeepSpeed's LRRangeTest(optimizer, lr_range_test_min_lr, lr_range_test_step_size, ...)."""
    return build_lr_scheduler(LR_RANGE_TEST, params, optimizer)
