"""zeroshard: ZeRO data parallelism for PyTorch with DeepSpeed's ds_config and training loop.

Example:
    >>> import zeroshard
    >>> engine, optimizer, dataloader, lr_scheduler = zeroshard.initialize(  # doctest: +SKIP
    ...     model=model, model_parameters=model.parameters(), training_data=dataset, config="ds_config.json")

`import zeroshard as deepspeed` gives a DeepSpeed script the names it uses (`add_config_arguments`,
`init_distributed`, `accelerator`, `comm`, `ops`, `runtime`, `utils`, `zero`); docs/compat.md lists them.
"""

from zeroshard import accelerator, comm, ops, runtime, utils, zero
from zeroshard.arguments import add_config_arguments
from zeroshard.comm.api import init_distributed
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
    "accelerator",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
    "ops",
    "runtime",
    "utils",
    "zero",
    "zero_init",
    "__version__",
]
