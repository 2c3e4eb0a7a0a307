"""Casting what the strategies do not shard: floating buffers (and frozen parameters) follow the compute dtype."""

from __future__ import annotations

import torch
from torch import nn


def cast_floating_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers follow the compute dtype, as DeepSpeed's module cast does."""
    for submodule in module.modules():
        for name, buf in submodule.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                setattr(submodule, name, buf.to(dtype))
