"""The I/O mechanism under the NVMe tier: positional reads and writes on a few worker threads.

[Note: threads over pread/pwrite] DeepSpeed reaches NVMe through libaio, compiled on the user's machine
(`async_io` op), and a failed libaio build is one of its most reported problems. We need no build step:
`os.preadv`/`os.pwritev` release the GIL for the whole system call, so N Python threads keep N requests in
flight on the device, which is what libaio's queue does for a stream of large sequential blocks. The
io_uring binding on PyPI (`liburing`, an abi3 wheel that leaves torch alone) was measured beside them in
benchmarks/nvme_swap.py: one ring 32 deep reached 2.20 GB/s write / 1.87 GB/s read where 4 threads reached
2.04 / 1.53 and the swapper with 8 threads 2.20 / 1.94 (docs/offload_nvme.md). Not clearly faster, so not
worth a dependency.

[Note: O_DIRECT] Swap files are written once and read once per step; the page cache would only double
the host memory they occupy (the thing NVMe offload exists to save) and make throughput numbers lie.
So files are opened with O_DIRECT when the filesystem accepts it, which requires the buffer address,
the file offset and the length to be multiples of the logical block size (we use 4096, a multiple of
every common one). Where O_DIRECT is refused (some network and FUSE filesystems), we fall back to
buffered I/O and drop the written or read pages with fdatasync + posix_fadvise(DONTNEED).
"""

from __future__ import annotations

import enum
import mmap
import os
import queue
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from zeroshard.utils.logging import get_logger

ALIGNMENT = 4096
_JOIN_TIMEOUT_S = 30.0
_LOG = get_logger(__name__)


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """The smallest multiple of `alignment` that is >= `n`."""
    return -(-n // alignment) * alignment


class IoMode(enum.Enum):
    """How swap files are opened; chosen once per swap directory by `probe_io_mode`."""

    DIRECT = "O_DIRECT"
    BUFFERED = "buffered+fadvise(DONTNEED)"


def probe_io_mode(directory: Path) -> IoMode:
    """Write and read back one aligned block with O_DIRECT in `directory`; BUFFERED if anything refuses.

    Opening with O_DIRECT is not enough: some filesystems accept the flag and fail the first I/O.
    """
    if not hasattr(os, "O_DIRECT"):
        return IoMode.BUFFERED
    probe = directory / f".odirect_probe_{uuid.uuid4().hex[:8]}"
    block = mmap.mmap(-1, ALIGNMENT)  # anonymous mappings are page-aligned
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        try:
            view = memoryview(block)
            if os.pwritev(fd, [view], 0) != ALIGNMENT or os.preadv(fd, [view], 0) != ALIGNMENT:
                return IoMode.BUFFERED
            view.release()
        finally:
            os.close(fd)
    except OSError:
        return IoMode.BUFFERED
    finally:
        block.close()
        probe.unlink(missing_ok=True)
    return IoMode.DIRECT


def open_flags(mode: IoMode, write: bool) -> int:
    """`os.open` flags for a swap file: write opens create but never truncate (rewrites go in place)."""
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    if mode is IoMode.DIRECT:
        flags |= os.O_DIRECT
    return flags | getattr(os, "O_CLOEXEC", 0)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of `view` at `offset` (a regular file may accept fewer bytes per call)."""
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)


def pread_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill all of `view` from `offset`; raises EOFError naming `path` if the file ends first."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise EOFError(
                f"swap file {path} ends at byte {offset + done}, expected {len(view) - done} more bytes "
                f"(file truncated or overwritten?)"
            )
        done += got


def drop_cached_pages(fd: int, write: bool) -> None:
    """Buffered mode only: flush (writes) and evict the file's pages so the next read comes from disk."""
    if write:
        os.fdatasync(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class Workers:
    """`threads` daemon threads running callables from one FIFO queue.

    `max_queued` bounds the callables waiting (not running); `submit` blocks past it, which is the
    back-pressure on the submitter. Callables must not raise: they report their own errors.
    """

    def __init__(self, threads: int, max_queued: int, name: str) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_queued)
        self._threads = [
            threading.Thread(target=_run, args=(self._queue,), name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        self._queue.put(task)

    def owns_current_thread(self) -> bool:
        return threading.current_thread() in self._threads

    def close(self) -> None:
        """Run what is queued, then stop every thread (idempotent)."""
        alive = [t for t in self._threads if t.is_alive()]
        for _ in alive:
            self._queue.put(None)
        for thread in alive:
            if thread is not threading.current_thread():
                thread.join(_JOIN_TIMEOUT_S)
        self._threads = []


def _run(tasks: queue.Queue[Callable[[], None] | None]) -> None:
    while (task := tasks.get()) is not None:
        try:
            task()
        except BaseException:  # a task that raises is a bug; keep the thread so the queue still drains
            _LOG.exception("NVMe I/O task raised")
