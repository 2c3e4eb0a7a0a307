"""`deepspeed.runtime.lr_schedules`: DeepSpeed's five schedules under their names and constructor signatures.

They are the classes ds_config `scheduler` builds (`optim.schedulers`, one implementation), so a scheduler that
`initialize` returns is an instance of these, and a script can build one itself:

Example:
    >>> import torch
    >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    >>> sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    >>> opt.param_groups[0]["lr"], isinstance(sched, WarmupLR)
    (0.0, True)
"""

from zeroshard.optim.schedulers import (
    LINEAR_WARMUP,
    LOG_WARMUP,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
WARMUP_LOG_RATE = LOG_WARMUP
WARMUP_LINEAR_RATE = LINEAR_WARMUP

__all__ = [
    "LRRangeTest",
    "LR_RANGE_TEST",
    "LR_SCHEDULE",
    "ONE_CYCLE",
    "OneCycle",
    "VALID_LR_SCHEDULES",
    "WARMUP_COSINE_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_LINEAR_RATE",
    "WARMUP_LOG_RATE",
    "WARMUP_LR",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]
