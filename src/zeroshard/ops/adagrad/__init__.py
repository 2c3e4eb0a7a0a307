"""`deepspeed.ops.adagrad`: DeepSpeedCPUAdagrad as torch's Adagrad, the step DeepSpeed's CPU kernel computes (the
squared gradients summed, the update divided by their root plus `eps`, weight decay added to the gradient): calling
it returns that optimizer, and `isinstance` holds for what it builds and for a config's Adagrad with the optimizer
offloaded, as DeepSpeed picks ([Note: DeepSpeed's optimizer classes] in optim/optimizers.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.ops._params import DeepSpeedOptimizerClass, param_groups
from zeroshard.optim.optimizers import DEEPSPEED_CLASS, build_optimizer


class DeepSpeedCPUAdagrad(metaclass=DeepSpeedOptimizerClass):
    """DeepSpeed's CPU Adagrad (its signature; `amsgrad` other than False is refused, as DeepSpeed's kernel has none).

    Example:
        >>> import torch
        >>> opt = DeepSpeedCPUAdagrad([torch.zeros(2, requires_grad=True)])
        >>> type(opt).__name__, opt.defaults["lr"], opt.defaults["eps"]
        ('Adagrad', 0.01, 1e-10)
    """

    def __new__(  # type: ignore[misc]
        cls,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> torch.optim.Optimizer:
        block = {
            "lr": lr,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "fp32_optimizer_states": fp32_optimizer_states,
        }
        optimizer = build_optimizer("Adagrad", block, param_groups(model_params))
        setattr(optimizer, DEEPSPEED_CLASS, "DeepSpeedCPUAdagrad")
        return optimizer


__all__ = ["DeepSpeedCPUAdagrad"]
