"""The NVMe swapper's mechanism: one driver thread, the I/O threads, and the staging copies between them.

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
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Protocol

import numpy
import torch

from zeroshard.offload.aio import IoMode, Workers, align_up, drop_cached_pages, pread_exact, pwrite_all
from zeroshard.offload.buffers import HostBufferPool
from zeroshard.offload.nvme_files import open_for_read, open_for_write, remove_swap_directory, swap_file_path
from zeroshard.offload.nvme_request import (
    NvmeSwapError,
    SwapFile,
    SwapHandle,
    SwapRequest,
    SwapSegment,
    plan_segments,
)
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


class SwapEngine:
    """The swapper's threads, buffers and files; kept apart from NvmeSwapper so its finalizer can own it."""

    def __init__(self, directory: Path, mode: IoMode, aio: AioSettings, pool: HostBufferPool) -> None:
        self.directory = directory
        self.mode = mode
        self.block_size = align_up(aio.block_size)
        self.overlap = aio.overlap_events
        self.pool = pool
        self.files: dict[str, SwapFile] = {}
        self.pending: set[SwapHandle] = set()
        self.errors: list[BaseException] = []  # since the last wait_all
        self.closed = False
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._serial = 0
        self.io_threads = io_threads(aio)
        self._io = Workers(self.io_threads, 2 * self.io_threads, "zeroshard-nvme-io")
        self._streams: dict[tuple[int, torch.device], torch.cuda.Stream] = {}  # per I/O thread and device
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
                record = self.files[key] = SwapFile(self._file_for(key), data.numel())
            elif record is None:
                raise KeyError(f"no NVMe swap file for key {key!r}: swap_out({key!r}, ...) it first")
            elif not write and record.nbytes != data.numel():
                raise ValueError(
                    f"swap_in({key!r}) into a tensor of {data.numel()} bytes, but {record.nbytes} bytes were "
                    f"swapped out ({record.path})"
                )
            record.nbytes = data.numel()
            request = SwapRequest(handle, record, data.numel(), data, out, record.last, _ready_event(tensor))
            record.last = handle
            self.pending.add(handle)
        self._driver.submit(lambda: self._drive(request))
        return handle

    def _file_for(self, key: str) -> Path:
        self._serial += 1
        return swap_file_path(self.directory, self._serial, key)

    # -- driver thread -------------------------------------------------------------------------------
    def _drive(self, request: SwapRequest) -> None:
        try:
            if request.after is not None:
                request.after.join()
            if request.ready is not None:
                request.ready.synchronize()
            self._open(request)
            for offset, nbytes, staged in plan_segments(request, self.mode, self.pool.buffer_bytes):
                if request.error is not None:
                    break
                segment = SwapSegment(request, self.pool.acquire() if staged else None, offset, nbytes)
                with request.lock:
                    request.pending += 1
                self._dispatch(segment)
                if not self.overlap:
                    segment.done.wait()
        except BaseException as err:
            request.fail(err)
        finally:
            self._release(request)

    def _open(self, request: SwapRequest) -> None:
        record, key = request.record, request.handle.key
        if request.write:
            request.fd = open_for_write(record.path, request.nbytes, self.mode)
            return
        if not record.valid:
            raise NvmeSwapError(f"key {key!r}: the last swap_out to {record.path} failed; nothing to read")
        request.fd = open_for_read(record.path, key, request.nbytes, self.mode)

    def _dispatch(self, segment: SwapSegment) -> None:
        padded = segment.nbytes if segment.buffer is None else align_up(segment.nbytes)
        chunks = range(0, padded, self.block_size)
        segment.remaining = len(chunks)
        for start in chunks:
            self._io.submit(functools.partial(self._transfer, segment, start, min(self.block_size, padded - start)))

    # -- I/O threads ---------------------------------------------------------------------------------
    def _transfer(self, segment: SwapSegment, start: int, length: int) -> None:
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
                    self._copy(buffer.tensor[start : start + valid], request.data[lo : lo + valid])
                    buffer.tensor[start + valid : start + length].zero_()
                    pwrite_all(request.fd, view, lo)
                else:
                    pread_exact(request.fd, view, lo, request.record.path)
                    self._copy(request.data[lo : lo + valid], buffer.tensor[start : start + valid])
        except BaseException as err:
            request.fail(err)
        with segment.lock:
            segment.remaining -= 1
            last = segment.remaining == 0
        if last:
            self._segment_done(segment)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A staging copy; one of a device tensor runs on a stream of this thread's own. On the thread's default
        stream (the legacy one, the compute stream's) it waited for every kernel queued, and the synchronize after
        it for those queued since, holding the I/O thread and the compute stream back alike; the request's ready
        event already orders it after the tensor's producer."""
        device = dst.device if dst.is_cuda else src.device if src.is_cuda else None
        if device is None:
            _copy(dst, src)
            return
        key = (threading.get_ident(), device)
        with self._lock:
            stream = self._streams.get(key)
            if stream is None:
                stream = self._streams[key] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            _copy(dst, src)

    def _segment_done(self, segment: SwapSegment) -> None:
        if segment.buffer is not None:
            self.pool.release(segment.buffer)
        segment.done.set()
        self._release(segment.request)

    def _release(self, request: SwapRequest) -> None:
        with request.lock:
            request.pending -= 1
            if request.pending:
                return
        self._finish(request)

    def _finish(self, request: SwapRequest) -> None:
        try:
            if request.fd >= 0 and request.error is None and self.mode is IoMode.BUFFERED:
                drop_cached_pages(request.fd, request.write)
            if request.out is not None and request.data is not None and request.error is None:
                self._copy(request.out, request.data.view(request.out.dtype).view(request.out.shape))
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
            request.handle.set_outcome(request.error)

    # -- lifetime ------------------------------------------------------------------------------------
    def wait_all(self) -> None:
        with self._lock:
            handles = list(self.pending)
        for handle in handles:
            handle.join()
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
            record.last.join()
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
            remove_swap_directory(self.directory)
            _LOG.debug(f"removed NVMe swap directory {self.directory}")
