"""Give freed host memory back to the operating system: the allocator policy of every CPU run and NVMe store.

[Note: glibc's mmap threshold]
glibc serves allocations above its mmap threshold (128 KiB at start) with mmap and unmaps them on free;
but each such free raises the threshold to the freed size (up to 32 MiB on 64-bit), after which
allocations of that size come from the heap, where freed memory stays in the process. NVMe offload frees
and re-allocates the same storages every step, so the heap would grow to hold all of them and the
process's RSS would approach what the offload was meant to save (measured: 1.45x the optimizer state
instead of 0.68x on a 105M-parameter model). Training on the CPU does the same with stage 3's gathered
units, reduction buffers and autograd's gradients: a 25M-parameter model's stage-3 RSS rose step after step
and ended above stage 0's (benchmarks/resident_memory.py, docs/benchmarks.md). Fixing the threshold (which
disables the adjustment) keeps large storages on mmap, so RSS follows the live tensors. A
MALLOC_MMAP_THRESHOLD_ set by the user wins; ZEROSHARD_HOST_ALLOC=glibc leaves glibc's default alone.

The price is a page fault for every 4 KiB of every large tensor allocated afresh: activations, autograd's
gradients, logits. On a 5.3M-parameter GPT (2 ranks, micro-batch 2 x 128 tokens) a stage-0 step took 27,700
minor faults with the policy and none without, and 1.3-2.4x the time on this 2-core machine (issue 21: it was
most of "stage 0 costs 20% more than DDP"). Stages 0-2 keep their buffers for the whole run (flat parameters,
gradients and optimizer state are allocated once), so their RSS does not climb under glibc's default; the
policy is therefore applied where it pays for itself: stage 3 (units gathered and released every step) and
any offload (storages freed and re-read every step), or everywhere with ZEROSHARD_HOST_ALLOC=fixed (the
resident-memory benchmark compares stages under one policy that way).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from functools import cache

import torch

from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
DEFAULT_THRESHOLD = 256 << 10


def fix_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Set glibc's mmap threshold to `threshold` bytes, once per process: [Note: glibc's mmap threshold].
    False where that is not possible (not glibc) or not wanted (MALLOC_MMAP_THRESHOLD_ set by the user,
    ZEROSHARD_HOST_ALLOC=glibc); the outcome is logged once at debug level."""
    return _fix_once(threshold)


def apply_host_policy(device: torch.device, churns: bool) -> bool:
    """The allocator policy for a run on `device` ([Note: glibc's mmap threshold]): on the CPU when the run
    allocates and frees large storages every step (`churns`: stage 3, offload) or ZEROSHARD_HOST_ALLOC=fixed."""
    wanted = churns or os.environ.get("ZEROSHARD_HOST_ALLOC", "").lower() == "fixed"
    return device.type == "cpu" and wanted and fix_mmap_threshold()


@cache
def _fix_once(threshold: int) -> bool:
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        logger.debug(
            "glibc mmap threshold: MALLOC_MMAP_THRESHOLD_=%s (set by the user) kept",
            os.environ["MALLOC_MMAP_THRESHOLD_"],
        )
        return False
    if os.environ.get("ZEROSHARD_HOST_ALLOC", "").lower() == "glibc":
        logger.debug("glibc mmap threshold: left dynamic (ZEROSHARD_HOST_ALLOC=glibc)")
        return False
    done = sys.platform.startswith("linux") and _mallopt(_M_MMAP_THRESHOLD, threshold)
    logger.debug("glibc mmap threshold: %s", f"fixed at {threshold} bytes" if done else "not changed (no mallopt)")
    return done


def _mallopt(param: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    return bool(mallopt(ctypes.c_int(param), ctypes.c_int(value)))
