"""The state of one NVMe swap: its handle, the key's file record, the request and its segments.

[Note: zero-copy] A host tensor whose address is a multiple of 4096 (or any host tensor in buffered mode)
is read and written in place: its chunks go straight between its memory and the file, and only an
unaligned tail goes through a staging buffer. On our 2-vCPU test VM the staging copy cost up to half the
bandwidth (docs/offload_nvme.md). Allocate host tensors that are swapped often with `aligned_zeros` to get
this; it also touches the pages from user space first (see [Note: touch buffers before O_DIRECT] in buffers.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zeroshard.errors import ZeroshardError
from zeroshard.offload.aio import ALIGNMENT, IoMode
from zeroshard.offload.buffers import HostBuffer


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

    def join(self) -> None:
        """Block until the request is finished, without raising its error: the swap engine orders requests
        on it and reports errors through `wait_all` instead."""
        self._done.wait()

    def set_outcome(self, error: BaseException | None) -> None:
        """Finish the request (called once, by the swap engine)."""
        self._error = error
        self._done.set()


@dataclass(eq=False)
class SwapFile:
    """One key's file and the latest requests on it."""

    path: Path
    nbytes: int  # of the latest swap_out submitted
    valid: bool = False  # the latest completed swap_out succeeded
    last: SwapHandle | None = None  # the latest request submitted on this key


@dataclass(eq=False)
class SwapRequest:
    """One swap_out or swap_in from submission to completion; see [Note: data flow of one swap] in nvme_engine.py."""

    handle: SwapHandle
    record: SwapFile
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
class SwapSegment:
    """The part of a request that goes through one staging buffer (or straight from the tensor's memory)."""

    request: SwapRequest
    buffer: HostBuffer | None  # None: the chunks use the tensor's own memory
    offset: int  # into the tensor bytes and the file
    nbytes: int
    remaining: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


def plan_segments(request: SwapRequest, mode: IoMode, buffer_bytes: int) -> list[tuple[int, int, bool]]:
    """(offset, bytes, staged) per segment of `request`; sets `request.view` when some go in place.

    See [Note: zero-copy].
    """
    assert request.data is not None
    data, total, step = request.data, request.nbytes, buffer_bytes
    direct = 0
    if data.device.type == "cpu" and total:
        if mode is IoMode.BUFFERED:
            direct = total
        elif data.data_ptr() % ALIGNMENT == 0:
            direct = total - total % ALIGNMENT
    if direct:
        request.view = data.numpy().data
    plan = [(offset, min(step, direct - offset), False) for offset in range(0, direct, step)]
    return plan + [(offset, min(step, total - offset), True) for offset in range(direct, total, step)]
