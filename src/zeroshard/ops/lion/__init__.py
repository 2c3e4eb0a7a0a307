"""`deepspeed.ops.lion`: FusedLion and DeepSpeedCPULion as the Lion zeroshard builds from ds_config
(`optim/lion.py`; DeepSpeed's are a CUDA and a CPU extension): calling one returns that optimizer, and `isinstance`
holds for what it builds and for a config's Lion, FusedLion or, with the optimizer offloaded, DeepSpeedCPULion, as
DeepSpeed picks ([Note: DeepSpeed's optimizer classes] in optim/optimizers.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.ops._params import DeepSpeedOptimizerClass, param_groups
from zeroshard.optim.optimizers import DEEPSPEED_CLASS, build_optimizer


def _lion(name: str, params: Iterable[Any], block: dict[str, Any]) -> torch.optim.Optimizer:
    optimizer = build_optimizer("Lion", block, param_groups(params))
    setattr(optimizer, DEEPSPEED_CLASS, name)
    return optimizer


class FusedLion(metaclass=DeepSpeedOptimizerClass):
    """DeepSpeed's FusedLion: builds zeroshard's Lion with its defaults.

    Example:
        >>> import torch
        >>> opt = FusedLion([torch.zeros(2, requires_grad=True)], lr=1e-4)
        >>> type(opt).__name__, isinstance(opt, FusedLion)
        ('Lion', True)
    """

    def __new__(  # type: ignore[misc]
        cls,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> torch.optim.Optimizer:
        block = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "set_grad_none": set_grad_none}
        return _lion("FusedLion", params, block)


class DeepSpeedCPULion(metaclass=DeepSpeedOptimizerClass):
    """DeepSpeed's CPU Lion: builds zeroshard's Lion (`fp32_optimizer_states` as DeepSpeedCPUAdam's)."""

    def __new__(  # type: ignore[misc]
        cls,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> torch.optim.Optimizer:
        block = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "fp32_optimizer_states": fp32_optimizer_states}
        return _lion("DeepSpeedCPULion", model_params, block)


__all__ = ["DeepSpeedCPULion", "FusedLion"]
