"""Torch-style parameter groups from what a DeepSpeed optimizer constructor accepts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """`params` (tensors, or dicts with "params") as a list of groups, as torch.optim.Optimizer reads them."""
    items = list(params)
    if items and isinstance(items[0], dict):
        return [dict(group) for group in items]
    return [{"params": items}]
