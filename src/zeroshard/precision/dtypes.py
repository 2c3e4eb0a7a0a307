"""The training dtypes by their config names: the one table every module looks them up in.

(The checkpoint format's safetensors codes are that format's own table, in checkpoint/safetensors_io.py; the
config's accepted spellings of these names are in config/fields.py, which does not import torch.)
"""

from __future__ import annotations

from typing import Final

import torch

DTYPES: Final[dict[str, torch.dtype]] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dtype_of(name: str) -> torch.dtype:
    """ "bf16" -> torch.bfloat16."""
    return DTYPES[name]


def bytes_of(name: str) -> int:
    """Bytes per element: "bf16" -> 2."""
    return DTYPES[name].itemsize
