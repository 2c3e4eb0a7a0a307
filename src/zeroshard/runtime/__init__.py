"""`deepspeed.runtime`: the modules DeepSpeed scripts import from it (`utils`, `lr_schedules`, `constants`, `config`,
`progressive_layer_drop`, `data_pipeline.curriculum_scheduler`, `pipe`), as thin names over zeroshard's own
implementations."""

from zeroshard.runtime import config, constants, data_pipeline, lr_schedules, progressive_layer_drop, utils

__all__ = ["config", "constants", "data_pipeline", "lr_schedules", "pipe", "progressive_layer_drop", "utils"]


def __getattr__(name: str) -> object:
    # `deepspeed.runtime.pipe....` without importing torch's pipelining until a script asks for it
    if name == "pipe":
        import importlib

        return importlib.import_module("zeroshard.runtime.pipe")
    raise AttributeError(f"module 'zeroshard.runtime' has no attribute {name!r}")
