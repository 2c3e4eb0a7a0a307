"""Optimizers and learning-rate schedulers built from ds_config `optimizer` / `scheduler` blocks."""

from zeroshard.optim.lion import Lion
from zeroshard.optim.optimizers import (
    as_deepspeed_builds,
    build_optimizer,
    optimizer_defaults,
    probe_optimizer,
    supported_optimizer_names,
)
from zeroshard.optim.schedulers import LRSchedulerLike, build_lr_scheduler, supported_scheduler_names

__all__ = [
    "LRSchedulerLike",
    "Lion",
    "as_deepspeed_builds",
    "build_lr_scheduler",
    "build_optimizer",
    "optimizer_defaults",
    "probe_optimizer",
    "supported_optimizer_names",
    "supported_scheduler_names",
]
