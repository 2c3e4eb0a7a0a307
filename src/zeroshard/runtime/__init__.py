"""`deepspeed.runtime`: the modules DeepSpeed scripts import from it (`utils`, `lr_schedules`, `constants`, `config`),
as thin names over zeroshard's own implementations."""

from zeroshard.runtime import config, constants, lr_schedules, utils

__all__ = ["config", "constants", "lr_schedules", "utils"]
