"""`deepspeed.ops.adam`: FusedAdam and DeepSpeedCPUAdam as the Adam/AdamW zeroshard builds from ds_config.

These are DeepSpeed's class names and signatures; calling one returns a `torch.optim.AdamW` (or `Adam` when
`adam_w_mode=False`, or `optim.adam.UncorrectedAdam` when `bias_correction=False`) built by `optim.build_optimizer`,
and `isinstance(opt, FusedAdam)` holds for it, as for a ds_config's Adam DeepSpeed would build as FusedAdam
([Note: DeepSpeed's optimizer classes] in optim/optimizers.py). With ZeRO offload the engine steps on CPU with the
same torch optimizer, so DeepSpeedCPUAdam is the same optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.ops._params import DeepSpeedOptimizerClass, param_groups
from zeroshard.optim.optimizers import DEEPSPEED_CLASS, build_optimizer


class FusedAdam(metaclass=DeepSpeedOptimizerClass):
    """DeepSpeed's FusedAdam: builds torch's Adam/AdamW; `isinstance(opt, FusedAdam)` holds for what it builds."""

    def __new__(  # type: ignore[misc]
        cls,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> torch.optim.Optimizer:
        """The optimizer ds_config `{"type": "Adam", "params": {...}}` builds, with FusedAdam's defaults.

        `bias_correction=False` returns `optim.adam.UncorrectedAdam` (torch's Adam always corrects), and
        `amsgrad=True` raises as in DeepSpeed's FusedAdam.

        Example:
            >>> import torch
            >>> opt = FusedAdam([torch.zeros(2, requires_grad=True)], lr=1e-4)
            >>> type(opt).__name__, opt.defaults["weight_decay"]
            ('AdamW', 0.0)
        """
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        params_block = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "adam_w_mode": adam_w_mode,
            "weight_decay": weight_decay,
            "set_grad_none": set_grad_none,
        }
        return build_optimizer("Adam", params_block, param_groups(params))


class DeepSpeedCPUAdam(metaclass=DeepSpeedOptimizerClass):
    """DeepSpeed's CPU Adam: builds torch's Adam/AdamW; `isinstance` holds for what it builds and for a config's Adam
    with the optimizer offloaded."""

    def __new__(  # type: ignore[misc]
        cls,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> torch.optim.Optimizer:
        """The optimizer ds_config `{"type": "Adam"}` builds, under DeepSpeedCPUAdam's signature (`adamw_mode`).

        Example:
            >>> import torch
            >>> type(DeepSpeedCPUAdam([torch.zeros(2, requires_grad=True)], adamw_mode=False)).__name__
            'Adam'
        """
        params_block = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "adam_w_mode": adamw_mode,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "fp32_optimizer_states": fp32_optimizer_states,
        }
        optimizer = build_optimizer("Adam", params_block, param_groups(model_params))
        setattr(optimizer, DEEPSPEED_CLASS, "DeepSpeedCPUAdam")
        return optimizer


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
