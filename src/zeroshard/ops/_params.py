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

    def __init__(cls, name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> None:
        base = next((b for b in bases if isinstance(b, DeepSpeedOptimizerClass)), None)
        if base is not None:  # its __new__ returns a torch optimizer: a subclass's __init__ would never run
            raise TypeError(
                f"class {name}({base.__name__}): {base.__name__} builds a torch optimizer here and cannot be derived "
                "from; derive from the torch optimizer it builds (torch.optim.AdamW, Adam, or zeroshard's Lamb)"
            )
        super().__init__(name, bases, namespace)

    def __instancecheck__(cls, instance: Any) -> bool:
        import torch

        from zeroshard.optim.optimizers import DEEPSPEED_CLASS

        # (the engine's view at ZeRO stages is no torch optimizer, as DeepSpeed's ZeRO optimizer is no FusedAdam)
        return isinstance(instance, torch.optim.Optimizer) and getattr(instance, DEEPSPEED_CLASS, None) == cls.__name__
