"""zeroshard: ZeRO data parallelism for PyTorch with DeepSpeed's ds_config and training loop.

Example:
    >>> import zeroshard
    >>> engine, optimizer, dataloader, lr_scheduler = zeroshard.initialize(  # doctest: +SKIP
    ...     model=model, model_parameters=model.parameters(), training_data=dataset, config="ds_config.json")
"""

from zeroshard.engine import Engine, MemoryReport
from zeroshard.errors import CollectiveMismatchError, ConfigError, LossScaleError, ZeroshardError
from zeroshard.initialize import initialize

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError",
    "ConfigError",
    "Engine",
    "LossScaleError",
    "MemoryReport",
    "ZeroshardError",
    "initialize",
    "__version__",
]
