"""[Note: pooled buffers between passes]: what the communication-buffer pool keeps, by device."""

from __future__ import annotations

import torch

from zeroshard.zero.pool import BufferPool


def _replay(pool: BufferPool, end_passes: bool) -> None:
    """Buckets of three sizes, one at a time, in two backwards (stage 3 ends each pass)."""
    for _ in range(2):
        for numel in (1000, 700, 300, 1000):
            pool.release(pool.acquire(numel, torch.float32, zero=False))
        if end_passes:
            pool.end_pass()


def test_the_host_pool_keeps_one_buffer_per_size_and_the_device_pool_none():
    flat = BufferPool(torch.device("cpu"))  # stages 0-2 on the host: kept (no allocator round trip per bucket)
    _replay(flat, end_passes=False)
    assert flat.held_bytes == (1000 + 700 + 300) * 4 and flat.peak_bytes == flat.held_bytes
    stage3 = BufferPool(torch.device("cpu"))  # handed back at the end of each backward
    _replay(stage3, end_passes=True)
    assert stage3.held_bytes == 0
    device = BufferPool(torch.device("meta"))  # as CUDA: the caching allocator is the pool (it held one per size)
    _replay(device, end_passes=False)
    assert device.held_bytes == 0 and device.peak_bytes == 1000 * 4
