"""Physical references measured in the same run as the micro-benchmarks: memory bandwidth."""

from __future__ import annotations

import time

import torch


def stream_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Memory bandwidth in bytes/s at the current torch thread count, best of `repeats`.

    Measured with an in-place `a.add_(b)` over two `nbytes` buffers (two reads and one write per
    element, counted as 3 x 4 bytes): the access pattern of an in-place optimizer step, which
    rewrites lines it has just read. A plain copy into a fresh buffer would also pay a hidden read
    of every destination line (write-allocate) and understate what the hardware can do.
    """
    a = torch.ones(nbytes // 4, dtype=torch.float32)
    b = torch.ones_like(a)
    a.add_(b)  # first touch of the pages
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a.add_(b)
        best = min(best, time.perf_counter() - start)
    return 3 * a.numel() * 4 / best
