"""`deepspeed.utils.module_utils`: a submodule or attribute by its dotted name (DeepSpeed-Chat's LoRA code imports
these through `deepspeed.compression.helper`).

Example:
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> recursive_setattr(net, "0", torch.nn.Identity())
    >>> type(recursive_getattr(net, "0")).__name__
    'Identity'
"""

from __future__ import annotations

from typing import Any


def recursive_getattr(model: Any, module_name: str) -> Any:
    """`model.a.b.c` for `module_name` "a.b.c"."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set `model.a.b.c = module` for `module_name` "a.b.c"."""
    *path, last = module_name.split(".")
    owner = recursive_getattr(model, ".".join(path)) if path else model
    owner.__setattr__(last, module)


__all__ = ["recursive_getattr", "recursive_setattr"]
