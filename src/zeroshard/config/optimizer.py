"""The `optimizer` and `scheduler` blocks: a type name and its keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroshard.config.fields import Bool, ConfigBlock, Str, option, params
from zeroshard.errors import ConfigError


def _type_name(value: object, path: str) -> str:
    name = Str()(value, path)
    if not name.strip():
        raise ConfigError(f'{path}: an empty string is not a type name; e.g. "AdamW"')
    return name


@dataclass(frozen=True)
class OptimizerConfig(ConfigBlock):
    """`optimizer`: which optimizer to build and its keyword arguments."""

    REQUIRED = ("type",)

    type: str = option("", 'Optimizer name, e.g. "AdamW" (DeepSpeed matches its own names ignoring case).', _type_name)
    params: dict[str, Any] = params('Keyword arguments (lr, betas, eps, weight_decay, ...); values may be "auto".')
    legacy_fusion: bool = option(False, "Legacy fused-optimizer switch (kept for compatibility).", Bool())


@dataclass(frozen=True)
class SchedulerConfig(ConfigBlock):
    """`scheduler`: which learning-rate scheduler to build and its keyword arguments."""

    REQUIRED = ("type",)

    type: str = option("", 'Scheduler name, e.g. "WarmupLR" or "WarmupCosineLR".', _type_name)
    params: dict[str, Any] = params(
        'Keyword arguments (warmup_min_lr, warmup_max_lr, warmup_num_steps, total_num_steps, ...); may be "auto".'
    )
