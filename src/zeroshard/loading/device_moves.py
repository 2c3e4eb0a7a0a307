"""Device moves of a model built under `zero_init`, inside the block ([Note: device moves under zero_init])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

DEVICE_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda})


def kept_on_meta(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None:
    """[Note: device moves under zero_init]
    A model built under `zero_init` and moved in the block (`Son().cpu()`, `.to(device)`, `.cuda()`, as DeepSpeed's
    tests and scripts do) asked its meta tensors to copy out of the meta device, which torch refuses: the move is
    the engine's to make (it materialises each unit on its device), so on a recorded meta tensor a device move is
    the tensor itself, and a move with a dtype keeps only the dtype (recorded as any call). None: the tensor
    itself. (After the block no torch function mode sees the move: torch's meta error stands there.)"""
    tensor = args[0]
    if func is not torch.Tensor.to:
        return None
    device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    if device is None or device.type == "meta":
        return func, args, kwargs
    if dtype is None or dtype == tensor.dtype:
        return None
    return func, (tensor,), {"dtype": dtype}
