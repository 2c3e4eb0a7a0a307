"""Torch-style parameter groups from what a DeepSpeed optimizer constructor accepts, and the type of DeepSpeed's
optimizer class names."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """`params` (tensors, or dicts with "params") as a list of groups, as torch.optim.Optimizer reads them."""
    items = list(params)
    if items and isinstance(items[0], dict):
        return [dict(group) for group in items]
    return [{"params": items}]


class DeepSpeedOptimizerClass(type):
    """The type of `FusedAdam` and its relatives: calling one builds zeroshard's optimizer, and `isinstance` holds for
    the optimizers built under its name ([Note: DeepSpeed's optimizer classes] in optim/optimizers.py)."""

    def __instancecheck__(cls, instance: Any) -> bool:
        import torch

        from zeroshard.optim.optimizers import DEEPSPEED_CLASS

        # (the engine's view at ZeRO stages is no torch optimizer, as DeepSpeed's ZeRO optimizer is no FusedAdam)
        return isinstance(instance, torch.optim.Optimizer) and getattr(instance, DEEPSPEED_CLASS, None) == cls.__name__
