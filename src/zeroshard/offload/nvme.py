"""ZeRO-Infinity's NVMe tier: tensors swapped to files on a local drive, asynchronously.

    >>> import tempfile, torch
    >>> from zeroshard.config import AioConfig
    >>> swapper = NvmeSwapper(tempfile.mkdtemp(), AioConfig(), buffer_count=2, buffer_bytes=1 << 20, pin=False)
    >>> x = torch.randn(1000)
    >>> swapper.swap_out("x", x).wait()
    >>> y = torch.empty_like(x)
    >>> swapper.swap_in("x", y).wait()
    >>> torch.equal(x, y)
    True
    >>> swapper.close()

`NvmeSwapper` is the interface; behind it, `nvme_engine.py` runs the threads (see [Note: data flow of one
swap] and [Note: aio mapping] there), `nvme_request.py` holds one swap's state and handle (see
[Note: zero-copy]), `nvme_files.py` names, creates and checks the files (see [Note: file layout]), and
`aio.py` and `buffers.py` give the system calls and the staging buffers.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

from zeroshard.errors import ConfigError
from zeroshard.offload.aio import IoMode, align_up, probe_io_mode
from zeroshard.offload.buffers import HostBufferPool
from zeroshard.offload.nvme_engine import AioSettings, SwapEngine
from zeroshard.offload.nvme_files import make_swap_directory, remove_swap_directory
from zeroshard.offload.nvme_request import NvmeSwapError, SwapHandle
from zeroshard.utils.logging import get_logger

_LOG = get_logger(__name__)


class NvmeSwapper:
    """Asynchronous swap of tensors to files under `path`, through a bounded pool of host buffers.

    `aio` maps DeepSpeed's `aio` block (see [Note: aio mapping] in nvme_engine.py): `block_size` bytes per
    pread/pwrite (rounded up to 4096); `intra_op_parallelism` x `queue_depth` requests in flight, one I/O thread
    each (at most 64); `overlap_events` stages the next buffer while the previous one is written or read.
    `buffer_count` buffers of `buffer_bytes` (rounded up to 4096; pinned if `pin` and CUDA is available)
    bound the host memory used; a tensor larger than a buffer streams through several, and a 4096-aligned
    host tensor needs none (see [Note: zero-copy] in nvme_request.py). `mode` forces O_DIRECT or buffered
    I/O (default: O_DIRECT if the filesystem accepts it).

    Keep a swapped-out tensor unchanged, and don't read a swap_in target, until its handle's `wait()`.
    """

    def __init__(
        self,
        path: str | Path,
        aio: AioSettings,
        buffer_count: int,
        buffer_bytes: int,
        pin: bool,
        *,
        mode: IoMode | None = None,
    ) -> None:
        sizes = {
            "aio.block_size": aio.block_size,
            "aio.queue_depth": aio.queue_depth,
            "aio.intra_op_parallelism": aio.intra_op_parallelism,
            "buffer_count": buffer_count,
            "buffer_size": buffer_bytes,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ConfigError(f"{name} must be >= 1 for NVMe offload, got {value}")
        pool = HostBufferPool(buffer_count, buffer_bytes, pin=pin and torch.cuda.is_available())
        directory = make_swap_directory(path)
        try:
            mode = mode or probe_io_mode(directory)
            self._engine = SwapEngine(directory, mode, aio, pool)
        except BaseException:
            remove_swap_directory(directory)
            raise
        # Runs at close(), when the swapper is garbage collected, or at interpreter exit, whichever is first;
        # it holds the engine, not the swapper, so it does not keep the swapper alive.
        self._finalizer = weakref.finalize(self, self._engine.close)
        _LOG.info(
            f"NVMe swap directory {directory}: {mode.value}, {self._engine.io_threads} I/O thread(s) x "
            f"{self._engine.block_size} B blocks, {buffer_count} x {pool.buffer_bytes} B "
            f"{'pinned ' if pool.pinned else ''}buffers"
        )

    @property
    def directory(self) -> Path:
        """The per-process directory holding the swap files."""
        return self._engine.directory

    @property
    def io_mode(self) -> IoMode:
        return self._engine.mode

    @property
    def buffers_allocated(self) -> int:
        """Staging buffers allocated so far (never more than `buffer_count`)."""
        return self._engine.pool.allocated

    @property
    def disk_bytes(self) -> int:
        """Bytes the swap files take on disk (each padded to 4096)."""
        return sum(align_up(f.nbytes) for f in list(self._engine.files.values()))

    def __contains__(self, key: str) -> bool:
        return key in self._engine.files

    def swap_out(self, key: str, tensor: torch.Tensor) -> SwapHandle:
        """Start writing `tensor`'s bytes (any dtype, device, shape; views allowed) to the file for `key`."""
        return self._engine.submit(key, tensor, write=True)

    def swap_in(self, key: str, out: torch.Tensor) -> SwapHandle:
        """Start reading `key` into `out`, which must have as many bytes as were swapped out."""
        return self._engine.submit(key, out, write=False)

    def wait_all(self) -> None:
        """Wait for every request made so far; raise the first error of any request since the last wait_all."""
        self._engine.wait_all()

    def remove(self, key: str) -> None:
        """Delete `key`'s file once its pending requests finish (a key not swapped out is ignored)."""
        self._engine.remove(key)

    def close(self) -> None:
        """Finish pending requests, stop the I/O threads and delete every swap file and the directory."""
        self._finalizer()

    def __enter__(self) -> NvmeSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["AioSettings", "NvmeSwapError", "NvmeSwapper", "SwapHandle"]
