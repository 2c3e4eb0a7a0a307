"""zeroshard: ZeRO data parallelism for PyTorch with DeepSpeed's ds_config and training loop.

Example:
    >>> import zeroshard
    >>> engine, optimizer, dataloader, lr_scheduler = zeroshard.initialize(  # doctest: +SKIP
    ...     model=model, model_parameters=model.parameters(), training_data=dataset, config="ds_config.json")

`import zeroshard as deepspeed` gives a DeepSpeed script the names it uses (`add_config_arguments`,
`init_distributed`, `accelerator`, `comm`, `ops`, `profiling`, `runtime`, `utils`, `zero`, `OnDevice`, and
`DeepSpeedEngine`, `DeepSpeedHybridEngine`, `PipelineEngine`, `PipelineModule`, `DeepSpeedConfigError`, `log_dist`,
`logger` as names of zeroshard's own); docs/compat.md lists them.
"""

import re as _re

from zeroshard import accelerator, comm, ops, profiling, runtime, utils, zero
from zeroshard.arguments import add_config_arguments
from zeroshard.comm.api import init_distributed
from zeroshard.engine import Engine, MemoryReport
from zeroshard.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    LossScaleError,
    ZeroshardError,
)
from zeroshard.initialize import initialize
from zeroshard.utils.init_on_device import OnDevice
from zeroshard.zero.stage3.gathered import GatheredParameters
from zeroshard.zero.stage3.meta import zero_init

__version__ = "0.1.0"
# DeepSpeed's version attributes (its build writes the git ones; "[none]" is what an uninstalled DeepSpeed says)
__version_major__, __version_minor__, __version_patch__ = (
    int(_re.sub(r"\D.*", "", part) or 0) for part in (__version__.split(".") + ["0"] * 3)[:3]
)  # "0.1.0rc1" -> 0, 1, 0: each part's leading digits
__git_hash__ = __git_branch__ = "[none]"

# DeepSpeed's top-level names for zeroshard's classes (`isinstance(model, deepspeed.DeepSpeedEngine)`), loaded on first
# use: the pipeline's pulls torch.distributed.pipelining in
_DEEPSPEED_NAMES = {
    "DeepSpeedEngine": ("zeroshard.engine", "Engine"),
    "DeepSpeedHybridEngine": ("zeroshard.hybrid_engine", "HybridEngine"),
    "PipelineEngine": ("zeroshard.pipe.engine", "PipelineEngine"),
    "PipelineModule": ("zeroshard.pipe", "PipelineModule"),
    "DeepSpeedConfigError": ("zeroshard.errors", "ConfigError"),
    "log_dist": ("zeroshard.utils", "log_dist"),
    "logger": ("zeroshard.utils", "logger"),
    "get_accelerator": ("zeroshard.accelerator", "get_accelerator"),
    "tp_model_init": ("zeroshard.tp.model_init", "tp_model_init"),  # [Note: tp_model_init]
}
_SUBMODULES = (
    "checkpointing",
    "linear",
)  # `deepspeed.checkpointing` without an import of its own, as DeepSpeed's __init__


def __getattr__(name: str) -> object:
    if name in _DEEPSPEED_NAMES:
        import importlib

        module, attribute = _DEEPSPEED_NAMES[name]
        return getattr(importlib.import_module(module), attribute)
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"zeroshard.{name}")
    raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")


__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "Engine",
    "GatheredParameters",
    "LossScaleError",
    "MemoryReport",
    "OnDevice",
    "ZeroshardError",
    "accelerator",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
    "ops",
    "profiling",
    "runtime",
    "utils",
    "zero",
    "zero_init",
    "__version__",
]
