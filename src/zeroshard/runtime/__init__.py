"""`deepspeed.runtime`: the modules DeepSpeed scripts import from it (`utils`, `lr_schedules`, `constants`),
as thin names over zeroshard's own implementations."""

from zeroshard.runtime import constants, lr_schedules, utils

__all__ = ["constants", "lr_schedules", "utils"]
