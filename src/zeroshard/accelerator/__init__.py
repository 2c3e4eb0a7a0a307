"""`deepspeed.accelerator` for scripts that run with `import zeroshard as deepspeed`.

The device is the one `comm/topology.py` picks: CUDA when torch sees a GPU, else the CPU.

Example:
    >>> from zeroshard.accelerator import get_accelerator
    >>> get_accelerator().communication_backend_name() in ("nccl", "gloo")
    True
"""

from __future__ import annotations

import functools

import torch

from zeroshard.accelerator.device import Accelerator


@functools.cache
def get_accelerator() -> Accelerator:
    """The accelerator of this process (one per process, so its CPU peak-memory counter persists)."""
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")


__all__ = ["Accelerator", "get_accelerator"]
