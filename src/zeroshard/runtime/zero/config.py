"""`deepspeed.runtime.zero.config`: `ZeroStageEnum`, and DeepSpeed's ZeRO config classes built from keys.

`ZeroStageEnum`: scripts import it with `deepspeed.runtime.fp16.loss_scaler.LossScaler` to allow-list both for
`torch.load(weights_only=True)` of DeepSpeed checkpoints (`torch.serialization.add_safe_globals`); zeroshard's
checkpoints pickle neither.

`DeepSpeedZeroConfig(**keys)`, `DeepSpeedZeroOffloadParamConfig(**keys)`, `DeepSpeedZeroOffloadOptimizerConfig(
**keys)`: the `zero_optimization` block (and its offload blocks) read from keys without a whole ds_config, checked
as `initialize` checks them (aliases, deprecated keys, "auto" refused, one line per wrong key). The offload classes
give zeroshard's blocks (an instance check against them holds for those blocks); `DeepSpeedZeroConfig` reads as
zeroshard's block with DeepSpeed's field names (`prefetch_bucket_size` for `stage3_prefetch_bucket_size`, ...),
and its `offload_param` / `offload_optimizer` are None unless the keys ask for one, as DeepSpeed's are.

Example:
    >>> ZeroStageEnum(3) is ZeroStageEnum.weights, int(ZeroStageEnum.max_stage)
    (True, 3)
    >>> z = DeepSpeedZeroConfig(stage=3, stage3_prefetch_bucket_size=12345, cpu_offload=True)
    >>> z.prefetch_bucket_size, z.overlap_comm, z.offload_param, z.offload_optimizer.device
    (12345, True, None, 'cpu')
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from zeroshard.config.fields import ConfigBlock
from zeroshard.config.parse import build_block
from zeroshard.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


class ZeroStageEnum(int, Enum):
    """The ZeRO stages by what each one partitions, as DeepSpeed numbers them."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # an alias of `weights`, as in DeepSpeed


class _BlockClass(type):
    """A class whose call checks keys into its zeroshard block and whose instances are those blocks."""

    block: type[ConfigBlock]
    path: str

    def __call__(cls, **keys: Any) -> Any:
        return build_block(cls.block, keys, cls.path, logger)

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, cls.block)


class DeepSpeedZeroOffloadParamConfig(metaclass=_BlockClass):
    """`zero_optimization.offload_param` from keys (zeroshard's `OffloadParamConfig`)."""

    block = OffloadParamConfig
    path = "zero_optimization.offload_param"


class DeepSpeedZeroOffloadOptimizerConfig(metaclass=_BlockClass):
    """`zero_optimization.offload_optimizer` from keys (zeroshard's `OffloadOptimizerConfig`)."""

    block = OffloadOptimizerConfig
    path = "zero_optimization.offload_optimizer"


def _asks(keys: dict[str, Any], block: str, legacy: str) -> bool:
    return keys.get(block) is not None or bool(keys.get(legacy))


@dataclass(frozen=True)
class LeafModuleLists:
    """`leaf_module` as DeepSpeed's config holds it: lists (zeroshard's block holds tuples)."""

    classes: list[str]
    names: list[str]
    name_suffixes: list[str]


class DeepSpeedZeroConfig:
    """`zero_optimization` from keys: zeroshard's `ZeroConfig`, read with DeepSpeed's field names."""

    def __init__(self, **keys: Any):
        self._block = build_block(ZeroConfig, keys, "zero_optimization", logger)
        leaf = self._block.leaf_module
        self.leaf_module = LeafModuleLists(list(leaf.classes), list(leaf.names), list(leaf.name_suffixes))
        self.offload_param = self._block.offload_param if _asks(keys, "offload_param", "cpu_offload_param") else None
        asked = _asks(keys, "offload_optimizer", "cpu_offload")
        self.offload_optimizer = self._block.offload_optimizer if asked else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._block, name)

    def __repr__(self) -> str:
        return f"DeepSpeedZeroConfig({self._block.to_dict(include_defaults=False)})"


__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "ZeroStageEnum",
]
