"""The closure a torch optimizer's `step(closure)` may take: evaluated with gradients on (steps run under no_grad)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def evaluate(closure: Callable[[], float] | None) -> float | None:
    """`closure()` with autograd enabled, or None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
