"""zeroshard: ZeRO data parallelism for PyTorch with DeepSpeed's ds_config and training loop.

Example:
    >>> import zeroshard
    >>> engine, optimizer, dataloader, lr_scheduler = zeroshard.initialize(  # doctest: +SKIP
    ...     model=model, model_parameters=model.parameters(), training_data=dataset, config="ds_config.json")
"""

from zeroshard.engine import Engine, MemoryReport
from zeroshard.errors import CollectiveMismatchError, ConfigError, LossScaleError, ZeroshardError
from zeroshard.initialize import initialize
from zeroshard.zero.stage3.gathered import GatheredParameters
from zeroshard.zero.stage3.meta import zero_init

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError",
    "ConfigError",
    "Engine",
    "GatheredParameters",
    "LossScaleError",
    "MemoryReport",
    "ZeroshardError",
    "initialize",
    "zero_init",
    "__version__",
]
