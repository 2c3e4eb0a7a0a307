"""The dtype of the model's buffers under bf16/fp16 training: `data_types.buffer_dtype` and
`data_types.keep_in_fp32_modules`, as DeepSpeed 0.19.8 applies them.

[Note: buffer dtypes]
Parameters train in the compute dtype; buffers are not parameters and keep the dtype they were loaded with (a
rotary embedding's fp32 `inv_freq`, a routing bias), unless `data_types.buffer_dtype` names one: then every
floating buffer is cast to it. Either way, the buffers `keep_in_fp32_modules` names stay, or become, fp32: `"auto"`
(the default) takes the model's own Hugging Face lists, `_keep_in_fp32_modules_strict` under bf16 and fp16 and also
`_keep_in_fp32_modules` under fp16; a list gives name patterns (`*` for any characters, matched anywhere in the
buffer's qualified name, as transformers matches them); `[]` keeps nothing. The reason is numerical: an MoE routing
bias whose values differ by less than bf16's spacing there (DeepSeek-V3's `e_score_correction_bias`) sends tokens
to other experts once rounded. In fp32 training nothing is cast. This is DeepSpeed 0.19.8's engine (its module cast
no longer casts buffers); earlier releases, and zeroshard before, cast every floating buffer to the compute dtype.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

_CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def keep_in_fp32_pattern(module: nn.Module, setting: str | Sequence[str], dtype: torch.dtype) -> re.Pattern[str] | None:
    """The pattern of the buffer names of `module` to keep in fp32 when training in `dtype`; None when none are."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if isinstance(setting, str):  # "auto": the model's own lists
        patterns = set()
        for module_name, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
            for name in names:
                pattern = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(module_name)}\..*{pattern}" if module_name else pattern)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def buffers_matching(module: nn.Module, pattern: re.Pattern[str]) -> list[tuple[str, torch.Tensor]]:
    """(qualified name, buffer) of the floating buffers of `module` whose names `pattern` finds."""
    found = []
    for module_name, owner in module.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, buf in owner.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and pattern.search(prefix + name):
                found.append((prefix + name, buf))
    return found


def apply_buffer_dtypes(
    module: nn.Module, compute_dtype: torch.dtype, buffer_dtype: torch.dtype | None, keep: str | Sequence[str]
) -> None:
    """[Note: buffer dtypes]: cast `module`'s floating buffers in place (their tensors keep their identity)."""
    if compute_dtype == torch.float32:
        return
    pattern = keep_in_fp32_pattern(module, keep, compute_dtype)
    kept = buffers_matching(module, pattern) if pattern is not None else []
    for _, buf in kept:
        if buf.dtype != torch.float32:
            buf.data = buf.data.float()
    if kept:
        log_rank(
            logger, 20, f"zeroshard: buffers kept in fp32 (data_types.keep_in_fp32_modules): {[n for n, _ in kept]}"
        )
    if buffer_dtype is None:
        return
    skip = {id(buf) for _, buf in kept}
    for buf in module.buffers():
        if id(buf) not in skip and buf.dtype in _CASTABLE and buf.dtype != buffer_dtype:
            buf.data = buf.data.to(buffer_dtype)
