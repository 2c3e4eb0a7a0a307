"""`deepspeed.moe.utils`: the optimizer-group helpers DeepSpeed's MoE scripts call.

DeepSpeed needs the experts' parameters in optimizer groups of their own (marked `"moe": True`), so that its ZeRO
optimizer reduces them over the expert-data-parallel group. zeroshard finds the experts itself, from the model's
`MoE` layers, and splits every group it is given ([Note: experts under ZeRO] in moe/zero.py): the helper returns the
groups as they are, so a script that calls it works unchanged and the hyperparameters stay those of the groups.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | Iterable[dict[str, Any]], max_group_size: int | None = None
) -> list[dict[str, Any]]:
    """DeepSpeed's helper: the groups as a list (the engine splits experts out itself)."""
    if isinstance(param_groups, dict):
        return [param_groups]
    return list(param_groups)


def is_moe_param(param: nn.Parameter, model: nn.Module | None = None) -> bool:
    """Whether `param` belongs to an MoE layer's experts. zeroshard bolts no attribute onto parameters, so the
    model to look in is an argument (DeepSpeed reads `param.allreduce`); without it the answer is False."""
    from zeroshard.moe.zero import moe_layers

    if model is None:
        return False
    return any(param is p for m in moe_layers(model) for p in m.expert_parameters())
