"""`deepspeed.checkpoint.utils`: what scripts import from it to save a model's weights themselves.

Example:
    >>> import torch
    >>> from zeroshard.checkpoint.utils import clone_tensors_for_torch_save
    >>> view = torch.arange(10.0)[:2]
    >>> lean = clone_tensors_for_torch_save({"w": view, "meta": [view, 3]})
    >>> lean["w"].untyped_storage().nbytes(), lean["meta"][1]
    (8, 3)
"""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """`item` with every tensor in it (nested in lists, tuples and dicts) replaced by a detached copy on `device`,
    as DeepSpeed's: `torch.save` of a view writes the whole storage under it, and the parameters of stages 0-2 are
    views of one flat buffer (DeepSpeed-Chat and OpenRLHF save `clone_tensors_for_torch_save(module.state_dict())`)."""
    if torch.is_tensor(item):
        target = torch.device(device)
        return item.detach().clone() if target == item.device else item.detach().to(target)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
