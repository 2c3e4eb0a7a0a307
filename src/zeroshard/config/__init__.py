"""The ds_config schema: DeepSpeed-compatible keys, defaults, "auto" resolution and batch math.

    >>> from zeroshard.config import AUTO, parse_config, resolve_config
    >>> cfg = parse_config({"train_batch_size": "auto", "fp16": {"enabled": "auto"}})
    >>> cfg.train_batch_size is AUTO
    True
    >>> known = {"train_micro_batch_size_per_gpu": 4, "fp16.enabled": True}
    >>> cfg = resolve_config(cfg, world_size=2, known=known)
    >>> cfg.train_batch_size, cfg.fp16.enabled
    (8, True)

Modules: fields (sentinel, checkers, field helpers), schema and the block modules (zero, precision,
optimizer, monitor, features), parse, resolve, batch, checks, support (UNIMPLEMENTED).
"""

from zeroshard.config.batch import BatchSizes, complete_batch
from zeroshard.config.blocks import check_world
from zeroshard.config.features import (
    ActivationCheckpointingConfig,
    AioConfig,
    CheckpointConfig,
    ElasticityConfig,
)
from zeroshard.config.fields import AUTO, Auto, ConfigBlock
from zeroshard.config.monitor import (
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from zeroshard.config.optimizer import OptimizerConfig, SchedulerConfig
from zeroshard.config.parse import ConfigSource, parse_config
from zeroshard.config.precision import BF16Config, DataTypesConfig, FP16Config
from zeroshard.config.resolve import resolve_config
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.config.support import UNIMPLEMENTED, is_unimplemented, unimplemented_settings
from zeroshard.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "AUTO",
    "UNIMPLEMENTED",
    "ActivationCheckpointingConfig",
    "AioConfig",
    "Auto",
    "BF16Config",
    "BatchSizes",
    "CSVMonitorConfig",
    "CheckpointConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "ConfigBlock",
    "ConfigSource",
    "DataTypesConfig",
    "ElasticityConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "ZeroConfig",
    "ZeroshardConfig",
    "check_world",
    "complete_batch",
    "is_unimplemented",
    "parse_config",
    "resolve_config",
    "unimplemented_settings",
]
