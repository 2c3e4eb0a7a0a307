"""`deepspeed.runtime.zero.leaf_module_config`: the defaults of `zero_optimization.leaf_module` and the block from
keys ([Note: leaf modules] in zero/stage3/plan.py).

Example:
    >>> DeepSpeedZeroLeafModuleConfig(names=["model.moe"]).names, DEFAULT_LEAF_MODULE_NAMES
    (('model.moe',), [])
"""

from __future__ import annotations

from zeroshard.config.zero import _LEAF_CLASSES, LeafModuleConfig
from zeroshard.runtime.zero.config import _BlockClass

DEFAULT_LEAF_MODULE_CLASSES: list[str] = list(_LEAF_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


class DeepSpeedZeroLeafModuleConfig(metaclass=_BlockClass):
    """`zero_optimization.leaf_module` from keys (zeroshard's `LeafModuleConfig`; its lists are tuples)."""

    block = LeafModuleConfig
    path = "zero_optimization.leaf_module"


__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "DeepSpeedZeroLeafModuleConfig",
]
