"""`deepspeed.runtime.zero.partition_parameters`: the names scripts import from it (DeepSpeed-Chat and TRL import
`ZeroParamStatus`, which the `ds_status` of a stage-3 parameter holds: [Note: DeepSpeed's parameter attributes] in
zero/stage3/ds_param.py), and the two transformers' ZeRO-3 loading reads: `from_pretrained` and `from_config` under
`HfDeepSpeedConfig` enter `prevent_arange_dtype_change`, which swaps `zero_wrapper_for_fp_tensor_constructor` for a
version that leaves `_orig_torch_arange` alone and restores it after (an AttributeError here stopped them).
zeroshard's `zero.Init` records a model's construction instead of wrapping torch's constructors
([Note: initialisation recorded under zero_init]), so it changes no constructor's dtype and calls neither name; the
wrapper is DeepSpeed's function, for code that calls it itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zeroshard.accelerator import get_accelerator  # (transformers' arange wrapper reads it from this module)
from zeroshard.zero.deepspeed_api import Init, register_external_parameter, unregister_external_parameter
from zeroshard.zero.stage3.ds_param import ZeroParamStatus
from zeroshard.zero.stage3.gathered import GatheredParameters

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None, target_device: torch.device | None = None
) -> Callable[..., torch.Tensor]:
    """DeepSpeed's: `fn` building its tensor on `target_device` (where no device is given) and casting a floating
    one to `target_fp_dtype`."""

    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn


__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "get_accelerator",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]
