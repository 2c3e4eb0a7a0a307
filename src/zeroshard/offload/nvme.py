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

[Note: data flow of one swap] `swap_out`/`swap_in` only queue a request and return its handle. One driver
thread takes requests in order; for each it opens the key's file and cuts the tensor into segments of one
staging buffer each (see [Note: staging buffers] in buffers.py). Per segment it takes a buffer from the
pool (blocking while all `buffer_count` are out), copies the tensor bytes in (writes), and queues the
segment's `aio.block_size` chunks to the I/O threads (see [Note: threads over pread/pwrite] in aio.py and
[Note: aio mapping]). The I/O thread that finishes a segment's last chunk copies the buffer out (reads)
and returns the buffer; the one that finishes a request's last segment closes the file and completes the
handle. With `aio.overlap_events` the driver stages segment i+1 while segment i is on the wire; without
it, each segment completes before the next starts.

[Note: aio mapping] DeepSpeed's libaio handle runs `intra_op_parallelism` (alias `thread_count`) threads,
each keeping up to `queue_depth` requests of `block_size` bytes in flight. A thread blocked in pread/pwrite
has exactly one request in flight, so we run `intra_op_parallelism` x `queue_depth` I/O threads (capped at
64): the default `aio` block (1 x 8) keeps 8 requests in flight, as DeepSpeed's does. Threads that wait in
system calls cost no CPU. `single_submit` (io_submit one request per call instead of batches) has no
counterpart: every chunk is its own system call already. `overlap_events` is the pipelining described above.

[Note: one request at a time per key] A request waits for the previous request on the same key before it
touches the file, so `swap_out(k, a); swap_in(k, b)` reads what was written, and a rewrite never races a
read. Requests on different keys run concurrently.

[Note: CUDA streams] A device tensor may still be written (swap_out) or read (swap_in) by kernels queued on
the caller's stream when the request is made; an event recorded on that stream at submission is waited on
before the tensor is touched. Copies made by our threads are synchronous, so once `wait()` returns the data
is in place for any stream.

[Note: zero-copy] A host tensor whose address is a multiple of 4096 (or any host tensor in buffered mode)
is read and written in place: its chunks go straight between its memory and the file, and only an
unaligned tail goes through a staging buffer. On our 2-vCPU test VM the staging copy cost up to half the
bandwidth (docs/offload_nvme.md). Allocate host tensors that are swapped often with `aligned_zeros` to get
this; it also touches the pages from user space first (see [Note: touch buffers before O_DIRECT]).

[Note: file layout] One file per key, `<nvme_path>/zeroshard_swap_<pid>_<uid>/<n>_<key>.swp`, holding the
tensor's bytes padded with zeros to a multiple of 4096 (O_DIRECT lengths must be). Reading checks the file
is exactly that size, so a truncated or overwritten file fails with its name rather than returning garbage.
The directory is removed by `close()`, when the swapper is garbage collected, and at interpreter exit; a
SIGKILL leaves it behind (delete `zeroshard_swap_*` directories of processes that no longer run).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy
import torch

from zeroshard.errors import ConfigError, ZeroshardError
from zeroshard.offload.aio import (
    ALIGNMENT,
    IoMode,
    Workers,
    align_up,
    drop_cached_pages,
    open_flags,
    pread_exact,
    probe_io_mode,
    pwrite_all,
)
from zeroshard.offload.buffers import HostBuffer, HostBufferPool
from zeroshard.utils.logging import get_logger

_LOG = get_logger(__name__)
MAX_IO_THREADS = 64


class AioSettings(Protocol):
    """What the swapper reads from the `aio` block (`zeroshard.config.AioConfig` satisfies it)."""

    @property
    def block_size(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def intra_op_parallelism(self) -> int: ...
    @property
    def single_submit(self) -> bool: ...
    @property
    def overlap_events(self) -> bool: ...


class NvmeSwapError(ZeroshardError):
    """A swap file could not be written or read back (names the file and the key)."""


class SwapHandle:
    """The pending result of one `swap_out` or `swap_in`."""

    def __init__(self, key: str, write: bool) -> None:
        self.key = key
        self.write = write
        self._done = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the bytes are in the file (swap_out) or in `out` (swap_in); raise its error if any."""
        with torch.profiler.record_function("zeroshard.nvme_wait"):
            if not self._done.wait(timeout):
                raise TimeoutError(f"NVMe {'swap_out' if self.write else 'swap_in'} of {self.key!r} still running")
        if self._error is not None:
            raise self._error

    def _complete(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


@dataclass(eq=False)
class _SwapFile:
    path: Path
    nbytes: int  # of the latest swap_out submitted
    valid: bool = False  # the latest completed swap_out succeeded
    last: SwapHandle | None = None  # the latest request submitted on this key


@dataclass(eq=False)
class _Request:
    handle: SwapHandle
    record: _SwapFile
    nbytes: int
    data: torch.Tensor | None  # flat uint8 view of the source (write) or of the contiguous target (read)
    out: torch.Tensor | None  # read into a non-contiguous tensor: filled from `data` at the end
    after: SwapHandle | None
    ready: torch.cuda.Event | None
    view: memoryview | None = None  # of `data`, when chunks go straight to or from its memory
    fd: int = -1
    pending: int = 1  # the driver's token + one per dispatched segment; whoever takes it to 0 finishes
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def write(self) -> bool:
        return self.handle.write

    def fail(self, err: BaseException) -> None:
        with self.lock:
            if self.error is not None:
                return
            if isinstance(err, NvmeSwapError):
                self.error = err
            else:
                op = "swap_out" if self.write else "swap_in"
                self.error = NvmeSwapError(
                    f"NVMe {op} of key {self.handle.key!r} ({self.record.path}) failed: {type(err).__name__}: {err}"
                )
                self.error.__cause__ = err


@dataclass(eq=False)
class _Segment:
    request: _Request
    buffer: HostBuffer | None  # None: the chunks use the tensor's own memory
    offset: int  # into the tensor bytes and the file
    nbytes: int
    remaining: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


def io_threads(aio: AioSettings) -> int:
    """I/O threads for an `aio` block: one per request DeepSpeed would keep in flight (see [Note: aio mapping])."""
    return min(aio.intra_op_parallelism * aio.queue_depth, MAX_IO_THREADS)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy on the calling thread only: numpy's single-threaded memcpy for host tensors (torch's would wake
    its intra-op thread pool, which then competes with the I/O threads for the cores)."""
    if dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype == torch.uint8:
        numpy.copyto(dst.numpy(), src.numpy())
        return
    dst.copy_(src)
    if dst.is_cuda or src.is_cuda:  # a device-to-device copy is asynchronous even when non_blocking=False
        torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).synchronize()


def _ready_event(tensor: torch.Tensor) -> torch.cuda.Event | None:
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


class _SwapEngine:
    """The swapper's threads, buffers and files; kept apart from NvmeSwapper so its finalizer can own it."""

    def __init__(self, directory: Path, mode: IoMode, aio: AioSettings, pool: HostBufferPool) -> None:
        self.directory = directory
        self.mode = mode
        self.block_size = align_up(aio.block_size)
        self.overlap = aio.overlap_events
        self.pool = pool
        self.files: dict[str, _SwapFile] = {}
        self.pending: set[SwapHandle] = set()
        self.errors: list[BaseException] = []  # since the last wait_all
        self.closed = False
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._serial = 0
        self.io_threads = io_threads(aio)
        self._io = Workers(self.io_threads, 2 * self.io_threads, "zeroshard-nvme-io")
        self._driver = Workers(1, 0, "zeroshard-nvme-driver")

    # -- submission (caller's thread) ----------------------------------------------------------------
    def submit(self, key: str, tensor: torch.Tensor, write: bool) -> SwapHandle:
        tensor, out = tensor.detach(), None
        if write:
            data = _flat_bytes(tensor.contiguous())
        elif tensor.is_contiguous():
            data = _flat_bytes(tensor)
        else:
            out, data = tensor, _flat_bytes(torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device))
        handle = SwapHandle(key, write)
        with self._lock:
            if self.closed:
                raise NvmeSwapError(f"NVMe swapper at {self.directory} is closed; cannot swap {key!r}")
            record = self.files.get(key)
            if write and record is None:
                record = self.files[key] = _SwapFile(self._file_for(key), data.numel())
            elif record is None:
                raise KeyError(f"no NVMe swap file for key {key!r}: swap_out({key!r}, ...) it first")
            elif not write and record.nbytes != data.numel():
                raise ValueError(
                    f"swap_in({key!r}) into a tensor of {data.numel()} bytes, but {record.nbytes} bytes were "
                    f"swapped out ({record.path})"
                )
            record.nbytes = data.numel()
            request = _Request(handle, record, data.numel(), data, out, record.last, _ready_event(tensor))
            record.last = handle
            self.pending.add(handle)
        self._driver.submit(lambda: self._drive(request))
        return handle

    def _file_for(self, key: str) -> Path:
        self._serial += 1
        return self.directory / f"{self._serial:06d}_{re.sub(r'[^A-Za-z0-9._-]', '_', key)[:64]}.swp"

    # -- driver thread -------------------------------------------------------------------------------
    def _drive(self, request: _Request) -> None:
        try:
            if request.after is not None:
                request.after._done.wait()
            if request.ready is not None:
                request.ready.synchronize()
            self._open(request)
            for offset, nbytes, staged in self._plan(request):
                if request.error is not None:
                    break
                segment = _Segment(request, self.pool.acquire() if staged else None, offset, nbytes)
                with request.lock:
                    request.pending += 1
                self._dispatch(segment)
                if not self.overlap:
                    segment.done.wait()
        except BaseException as err:
            request.fail(err)
        finally:
            self._release(request)

    def _plan(self, request: _Request) -> list[tuple[int, int, bool]]:
        """(offset, bytes, staged) per segment; see [Note: zero-copy]."""
        assert request.data is not None
        data, total, step = request.data, request.nbytes, self.pool.buffer_bytes
        direct = 0
        if data.device.type == "cpu" and total:
            if self.mode is IoMode.BUFFERED:
                direct = total
            elif data.data_ptr() % ALIGNMENT == 0:
                direct = total - total % ALIGNMENT
        if direct:
            request.view = data.numpy().data
        plan = [(offset, min(step, direct - offset), False) for offset in range(0, direct, step)]
        return plan + [(offset, min(step, total - offset), True) for offset in range(direct, total, step)]

    def _open(self, request: _Request) -> None:
        path, padded = request.record.path, align_up(request.nbytes)
        if request.write:
            request.fd = os.open(path, open_flags(self.mode, write=True), 0o600)
            os.ftruncate(request.fd, padded)
            return
        if not request.record.valid:
            raise NvmeSwapError(f"key {request.handle.key!r}: the last swap_out to {path} failed; nothing to read")
        try:
            request.fd = os.open(path, open_flags(self.mode, write=False))
        except FileNotFoundError as err:
            raise NvmeSwapError(f"swap file {path} for key {request.handle.key!r} is missing (deleted?)") from err
        size = os.fstat(request.fd).st_size
        if size != padded:
            raise NvmeSwapError(
                f"swap file {path} for key {request.handle.key!r} has {size} bytes, expected {padded} "
                f"({request.nbytes} tensor bytes padded to {ALIGNMENT}): truncated or overwritten"
            )

    def _dispatch(self, segment: _Segment) -> None:
        padded = segment.nbytes if segment.buffer is None else align_up(segment.nbytes)
        chunks = range(0, padded, self.block_size)
        segment.remaining = len(chunks)
        for start in chunks:
            self._io.submit(functools.partial(self._transfer, segment, start, min(self.block_size, padded - start)))

    # -- I/O threads ---------------------------------------------------------------------------------
    def _transfer(self, segment: _Segment, start: int, length: int) -> None:
        """Move one chunk; the staging copy is done here too, so copies run in parallel with other I/O."""
        request, buffer = segment.request, segment.buffer
        valid = min(length, segment.nbytes - start)  # tensor bytes in this chunk; the rest is padding
        lo = segment.offset + start
        try:
            if request.error is None and buffer is None:
                assert request.view is not None
                if request.write:
                    pwrite_all(request.fd, request.view[lo : lo + length], lo)
                else:
                    pread_exact(request.fd, request.view[lo : lo + length], lo, request.record.path)
            elif request.error is None:
                assert request.data is not None and buffer is not None
                view = buffer.view[start : start + length]
                if request.write:
                    _copy(buffer.tensor[start : start + valid], request.data[lo : lo + valid])
                    buffer.tensor[start + valid : start + length].zero_()
                    pwrite_all(request.fd, view, lo)
                else:
                    pread_exact(request.fd, view, lo, request.record.path)
                    _copy(request.data[lo : lo + valid], buffer.tensor[start : start + valid])
        except BaseException as err:
            request.fail(err)
        with segment.lock:
            segment.remaining -= 1
            last = segment.remaining == 0
        if last:
            self._segment_done(segment)

    def _segment_done(self, segment: _Segment) -> None:
        if segment.buffer is not None:
            self.pool.release(segment.buffer)
        segment.done.set()
        self._release(segment.request)

    def _release(self, request: _Request) -> None:
        with request.lock:
            request.pending -= 1
            if request.pending:
                return
        self._finish(request)

    def _finish(self, request: _Request) -> None:
        try:
            if request.fd >= 0 and request.error is None and self.mode is IoMode.BUFFERED:
                drop_cached_pages(request.fd, request.write)
            if request.out is not None and request.data is not None and request.error is None:
                _copy(request.out, request.data.view(request.out.dtype).view(request.out.shape))
        except BaseException as err:
            request.fail(err)
        finally:
            if request.fd >= 0:
                os.close(request.fd)
            if request.write:
                request.record.valid = request.error is None
            request.data = request.out = request.ready = request.view = None
            with self._lock:
                self.pending.discard(request.handle)
                if request.error is not None:
                    self.errors.append(request.error)
            request.handle._complete(request.error)

    # -- lifetime ------------------------------------------------------------------------------------
    def wait_all(self) -> None:
        with self._lock:
            handles = list(self.pending)
        for handle in handles:
            handle._done.wait()
        with self._lock:
            errors, self.errors = self.errors, []
        if errors:
            raise errors[0]

    def remove(self, key: str) -> None:
        with self._lock:
            record = self.files.pop(key, None)
        if record is None:
            return
        if record.last is not None:
            record.last._done.wait()
        record.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Finish queued requests, stop the threads, delete the directory (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        if os.getpid() != self._owner_pid:  # a forked child exiting: the files belong to the parent
            return
        if self._driver.owns_current_thread() or self._io.owns_current_thread():
            # Collected by the garbage collector on one of our own threads: joining it here would deadlock.
            threading.Thread(target=self._shut_down, name="zeroshard-nvme-close", daemon=True).start()
        else:
            self._shut_down()

    def _shut_down(self) -> None:
        try:
            self._driver.close()
            self._io.close()
            self.pool.clear()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
            _LOG.debug(f"removed NVMe swap directory {self.directory}")


class NvmeSwapper:
    """Asynchronous swap of tensors to files under `path`, through a bounded pool of host buffers.

    `aio` maps DeepSpeed's `aio` block (see [Note: aio mapping]): `block_size` bytes per pread/pwrite
    (rounded up to 4096); `intra_op_parallelism` x `queue_depth` requests in flight, one I/O thread each
    (at most 64); `overlap_events` stages the next buffer while the previous one is written or read.
    `buffer_count` buffers of `buffer_bytes` (rounded up to 4096; pinned if `pin` and CUDA is available)
    bound the host memory used; a tensor larger than a buffer streams through several, and a 4096-aligned
    host tensor needs none (see [Note: zero-copy]). `mode` forces O_DIRECT or buffered I/O (default:
    O_DIRECT if the filesystem accepts it).

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
        directory = Path(path) / f"zeroshard_swap_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        directory.mkdir(mode=0o700)
        try:
            mode = mode or probe_io_mode(directory)
            self._engine = _SwapEngine(directory, mode, aio, pool)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
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
