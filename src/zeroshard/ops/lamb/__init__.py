"""`deepspeed.ops.lamb`: FusedLamb, as zeroshard's LAMB ([Note: LAMB on flat shards] in optim/lamb.py), which runs
wherever torch does (DeepSpeed's is a CUDA extension)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.errors import ConfigError
from zeroshard.ops._params import DeepSpeedOptimizerClass, param_groups
from zeroshard.optim.lamb import Lamb
from zeroshard.optim.optimizers import DEEPSPEED_CLASS


class FusedLamb(metaclass=DeepSpeedOptimizerClass):
    """DeepSpeed's FusedLamb: builds zeroshard's Lamb; `isinstance` holds for what it builds and a config's Lamb."""

    def __new__(  # type: ignore[misc]
        cls,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> torch.optim.Optimizer:
        """DeepSpeed's FusedLamb signature; `max_grad_norm` > 0 is refused (clip with the engine's
        `gradient_clipping`)."""
        if max_grad_norm > 0:
            raise ConfigError(
                f"FusedLamb(max_grad_norm={max_grad_norm}): clip with the ds_config's top-level gradient_clipping "
                "instead"
            )
        optimizer = Lamb(
            param_groups(params), lr, bias_correction, betas, eps, eps_inside_sqrt, weight_decay, max_coeff, min_coeff,
            amsgrad,
        )  # fmt: skip
        setattr(optimizer, DEEPSPEED_CLASS, "FusedLamb")
        return optimizer


__all__ = ["FusedLamb"]
