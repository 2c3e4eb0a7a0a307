"""`deepspeed.utils.torch`: `required_torch_version`, `register_grad_hook`, as DeepSpeed's tests and scripts call
them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.torch_version import TorchVersion


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """Whether the running torch is at least `min_version` and at most `max_version` (release numbers, local parts
    such as "+cpu" aside, as DeepSpeed compares them)."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version or max_version")
    running = TorchVersion(torch.__version__.split("+")[0])
    if min_version is not None and running < TorchVersion(str(min_version)):
        return False
    return not (max_version is not None and running > TorchVersion(str(max_version)))


def register_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
    """`hook(param)` after each gradient accumulation into `param.grad` (torch's post-accumulate-grad hook)."""
    return param.register_post_accumulate_grad_hook(hook)
