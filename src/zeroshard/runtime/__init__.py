"""`deepspeed.runtime`: the modules DeepSpeed scripts import from it (`utils`, `lr_schedules`, `constants`, `config`,
`progressive_layer_drop`, `data_pipeline.curriculum_scheduler`), as thin names over zeroshard's own implementations."""

from zeroshard.runtime import config, constants, data_pipeline, lr_schedules, progressive_layer_drop, utils

__all__ = ["config", "constants", "data_pipeline", "lr_schedules", "progressive_layer_drop", "utils"]
