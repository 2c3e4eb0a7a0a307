"""`deepspeed.utils.zero_to_fp32`'s lazy mode against its eager state dict (tests/distributed/test_checkpoint.py)."""

from __future__ import annotations

import torch


def lazy_mode_matches(ckpt: str, fp32: dict[str, torch.Tensor]) -> bool:
    """DeepSpeed's lazy_mode: shapes and dtypes before any read, the eager values at `.contiguous()`; its
    `to_torch_tensor` keeps tied names on one tensor and casts to a dtype given by DeepSpeed's names."""
    from zeroshard.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, to_torch_tensor

    lazy = get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
    cast = to_torch_tensor(lazy, dtype="torch.bfloat16")
    empty = to_torch_tensor(lazy, return_empty_tensor=True)
    return (
        lazy.keys() == fp32.keys()
        and all(lazy[n].shape == v.shape and torch.equal(lazy[n].contiguous(), v) for n, v in fp32.items())
        and all(torch.equal(cast[n], v.to(torch.bfloat16)) and empty[n].shape == v.shape for n, v in fp32.items())
        and lazy["lm_head.weight"] is lazy["wte.weight"]
        and cast["lm_head.weight"] is cast["wte.weight"]
    )
