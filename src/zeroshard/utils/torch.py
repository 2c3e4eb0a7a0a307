"""`deepspeed.utils.torch`: `required_torch_version`, `register_grad_hook`, as DeepSpeed's tests and scripts call
them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.torch_version import TorchVersion


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """Whether the running torch is at least `min_version` and at most `max_version`, compared as DeepSpeed compares
    them: the whole version, so "2.13.0+cpu" is above a `max_version` of 2.13."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version or max_version")
    running = TorchVersion(torch.__version__)
    if min_version is not None and running < TorchVersion(str(min_version)):
        return False
    return not (max_version is not None and running > TorchVersion(str(max_version)))


def register_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
    """`hook(param)` after each gradient accumulation into `param.grad` (torch's post-accumulate-grad hook)."""
    return param.register_post_accumulate_grad_hook(hook)
