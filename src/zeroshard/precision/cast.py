"""Casting what the strategies do not shard: floating buffers (and frozen parameters) follow the compute dtype;
with `fp16.auto_cast`, the forward's positional inputs are cast to fp16."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def cast_floating_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers follow the compute dtype, as DeepSpeed's module cast does."""
    for submodule in module.modules():
        for name, buf in submodule.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                setattr(submodule, name, buf.to(dtype))


def inputs_to_half(value: Any) -> Any:
    """`fp16.auto_cast`: every floating-point tensor in `value` (through lists, tuples and dicts) as fp16, the rest
    unchanged, as DeepSpeed's engine casts its forward's positional inputs (not its keyword inputs)."""
    if isinstance(value, dict):
        return {k: inputs_to_half(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [inputs_to_half(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a namedtuple by fields
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.half()
    return value
