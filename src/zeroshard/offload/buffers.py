"""A bounded pool of 4096-byte-aligned host staging buffers (pinned when CUDA is there to use them).

[Note: staging buffers] Every swap goes through these buffers, whatever the tensor: O_DIRECT needs an
aligned address and length that a user's tensor rarely has (torch's CPU allocator aligns to 64 bytes),
device tensors need host memory to land in, and pinned host memory is what makes that device copy a
DMA. `buffer_count` x `buffer_size` bounds the host memory the NVMe tier may hold at once, which is the
point of offloading to NVMe. Buffers are allocated on first use, so a pool that is never fully used
never costs its full size.

[Note: touch buffers before O_DIRECT] A buffer whose pages are first faulted in by an O_DIRECT read
(the kernel pinning user pages for the DMA) stayed at 0.6-0.9 GB/s for every later read on our virtio
disk, while the same buffer first written from user space read at 1.7-2.1 GB/s (benchmarks/nvme_swap.py,
docs/offload_nvme.md): the pages' physical layout decides how many segments each request needs. So a new
buffer is filled with zeros, sequentially from one thread, before its first use.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zeroshard.offload.aio import ALIGNMENT, align_up
from zeroshard.offload.pinned import EXACT_FROM, pinned_zeros


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose data pointer is a multiple of 4096 (pinned if `pin`)."""
    if pin and nbytes >= EXACT_FROM:
        # page-aligned and exactly sized ([Note: pinned memory without rounding]): torch's pinned allocator rounds
        # `nbytes + 4096` up to a power of two, twice the default 8 MiB buffer (block_size x queue_depth)
        exact = pinned_zeros(nbytes, torch.uint8)
        if exact.data_ptr() % ALIGNMENT == 0:  # (not if the driver refused the registration: torch's then)
            return exact
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % ALIGNMENT
    return raw[start : start + nbytes]


def aligned_zeros(shape: int | Sequence[int], dtype: torch.dtype = torch.float32, pin: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor at a 4096-aligned address, which `NvmeSwapper` reads and writes in place.

    >>> aligned_zeros((3, 5), torch.bfloat16).data_ptr() % 4096
    0
    """
    size = torch.Size([shape] if isinstance(shape, int) else shape)
    raw = aligned_empty(size.numel() * torch.empty((), dtype=dtype).element_size(), pin)
    raw.numpy().fill(0)  # see [Note: touch buffers before O_DIRECT]
    return raw.view(dtype).view(size)


@dataclass(frozen=True)
class HostBuffer:
    """One staging buffer: the tensor (for torch copies) and a memoryview of it (for os.preadv/pwritev)."""

    tensor: torch.Tensor
    view: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.view)


class HostBufferPool:
    """At most `count` buffers of `nbytes` (rounded up to 4096) each; `acquire` blocks while all are out.

    >>> pool = HostBufferPool(count=2, nbytes=10_000, pin=False)
    >>> buf = pool.acquire(); (buf.nbytes, buf.tensor.data_ptr() % 4096, pool.allocated)
    (12288, 0, 1)
    >>> pool.release(buf)
    """

    def __init__(self, count: int, nbytes: int, pin: bool) -> None:
        if count < 1 or nbytes < 1:
            raise ValueError(f"a buffer pool needs count >= 1 and nbytes >= 1, got count={count}, nbytes={nbytes}")
        self.count = count
        self.buffer_bytes = align_up(nbytes)
        self.pinned = pin
        # the buffers are made on the swapper's driver thread, whose current device is GPU 0: the exact pinned pages
        # register on the device current here (the rank's), not in a context made on GPU 0 by every rank
        self._device = torch.cuda.current_device() if pin and torch.cuda.is_available() else None
        self._free: list[HostBuffer] = []
        self._allocated = 0
        self._high_water = 0
        self._cond = threading.Condition()

    @property
    def allocated(self) -> int:
        """Buffers allocated so far (never more than `count`)."""
        return self._allocated

    @property
    def high_water(self) -> int:
        """The most buffers ever handed out at the same time."""
        return self._high_water

    def acquire(self) -> HostBuffer:
        with self._cond:
            while not self._free and self._allocated >= self.count:
                self._cond.wait()
            if self._free:
                buf = self._free.pop()
            else:
                # Allocated under the lock so that `allocated` can never overshoot `count`.
                with torch.cuda.device(self._device) if self._device is not None else contextlib.nullcontext():
                    tensor = aligned_empty(self.buffer_bytes, self.pinned)
                array = tensor.numpy()
                array.fill(0)  # see [Note: touch buffers before O_DIRECT]
                buf = HostBuffer(tensor, array.data)
                self._allocated += 1
            self._high_water = max(self._high_water, self._allocated - len(self._free))
            return buf

    def release(self, buf: HostBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def clear(self) -> None:
        """Free the buffers not in use (those out are dropped when released)."""
        with self._cond:
            self._allocated -= len(self._free)
            self._free.clear()
