"""With `fp16.auto_cast`, the forward's positional inputs are cast to fp16 (buffers: precision/buffers.py)."""

from __future__ import annotations

from typing import Any

import torch


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
