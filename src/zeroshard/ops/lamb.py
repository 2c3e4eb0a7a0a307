"""`deepspeed.ops.lamb`: FusedLamb is refused, for the reason ds_config `"type": "Lamb"` is refused."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.ops._params import param_groups
from zeroshard.optim.optimizers import build_optimizer


def FusedLamb(params: Iterable[Any], *args: Any, **kwargs: Any) -> torch.optim.Optimizer:  # noqa: N802
    """Raises ConfigError: LAMB's per-tensor trust ratio is wrong on ZeRO's flat shards
    ([Note: elementwise optimizers only] in optim/optimizers.py); the error lists the optimizers we have."""
    return build_optimizer("Lamb", {}, param_groups(params))


__all__ = ["FusedLamb"]
