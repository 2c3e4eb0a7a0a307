"""`deepspeed.utils.safe_get_full_fp32_param` and friends: named, and refused with the alternative.

DeepSpeed finds a parameter's optimizer from the `ds_*` attributes it bolts onto every `nn.Parameter`; we
keep no such attributes, and only stage 3 registers its parameters ([Note: parameter registry]). Rather
than a second registry, or a per-parameter call that gathers the whole model, these refuse and name the
engine call that returns every full fp32 parameter at once.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

_ALTERNATIVE = (
    "is not provided yet (issue 22): call engine.consolidated_state_dict() on every rank, which returns every "
    "parameter's full fp32 master value by name"
)


def safe_get_full_fp32_param(param: torch.Tensor) -> NoReturn:
    """Refused; `engine.consolidated_state_dict()` returns every full fp32 parameter."""
    raise NotImplementedError(f"safe_get_full_fp32_param {_ALTERNATIVE}.")


def safe_get_full_grad(param: torch.Tensor) -> NoReturn:
    """Refused; gradients are reduced into shards and not kept whole."""
    raise NotImplementedError(f"safe_get_full_grad {_ALTERNATIVE}; full gradients are not kept.")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> Any:
    """Refused; engine.save_checkpoint() with zeroshard's export gives full optimizer state."""
    raise NotImplementedError(f"safe_get_full_optimizer_state {_ALTERNATIVE}; optimizer state is in checkpoints.")
