"""`deepspeed.runtime`: the modules DeepSpeed scripts import from it (`utils`, `lr_schedules`, `constants`, `config`,
`progressive_layer_drop`, `data_pipeline.curriculum_scheduler`, `pipe`, `engine`, `bf16_optimizer`, `fp16`,
`rollout`, `chunked_cross_entropy`, `dataloader`), as thin names over zeroshard's own implementations."""

from zeroshard.runtime import config, constants, data_pipeline, lr_schedules, progressive_layer_drop, utils

__all__ = [
    "bf16_optimizer",
    "chunked_cross_entropy",
    "config",
    "constants",
    "data_pipeline",
    "dataloader",
    "engine",
    "fp16",
    "lr_schedules",
    "pipe",
    "progressive_layer_drop",
    "rollout",
    "utils",
]


_LAZY = ("pipe", "engine", "bf16_optimizer", "fp16", "rollout", "chunked_cross_entropy", "dataloader")


def __getattr__(name: str) -> object:
    # `deepspeed.runtime.pipe....` without importing torch's pipelining, and the engine's modules, until a script asks
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"zeroshard.runtime.{name}")
    raise AttributeError(f"module 'zeroshard.runtime' has no attribute {name!r}")
