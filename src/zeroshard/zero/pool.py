"""Reusable communication buffers, and the queue of collectives in flight (shared by every stage)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from zeroshard.comm.collectives import Handle
from zeroshard.offload.host_memory import fresh_empty

T = TypeVar("T")


class BufferPool:
    """Reusable communication buffers keyed by (numel, dtype): no allocator round trip per bucket.

    [Note: pooled buffers between passes]
    Within a backward the same few sizes are acquired and released over and over, so free buffers are kept for
    reuse. Between backwards they are idle through the forward and the optimizer step, which is when activations
    and optimizer temporaries peak. On CUDA the pool keeps nothing: a released buffer goes back to the caching
    allocator at once, which serves the next bucket from its cache and lets activations and optimizer temporaries
    use the block in between. Kept here, one per distinct bucket size, they stayed allocated: replaying the buckets'
    acquires and releases for a Llama-7B-shaped layout at 8 ranks (7 sizes) held 6.6 GB where 1 GB was ever in use.
    Stage 3 on host memory hands them back at `end_pass`, and the allocator policy ([Note: glibc's mmap threshold])
    returns them to the operating system, so the resident set follows what a pass uses instead of the largest buffer of
    every size. Stages 0-2 keep theirs on the host too (they never call `end_pass`): a few bucket-sized buffers, since a
    parameter larger than a bucket is reduced from its own gradient ([Note: a bucket of one parameter reduces its own
    gradient]); handing them back each backward saved 100 MiB of peak resident memory on a 124M GPT at stage 2 but cost
    10-20% of its step on the CPU (measured, 2 ranks), every buffer faulted in again.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.keeps = device.type == "cpu"  # the CUDA caching allocator is the pool there
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._in_use_bytes = 0
        self.peak_bytes = 0

    def acquire(self, numel: int, dtype: torch.dtype, zero: bool = True) -> torch.Tensor:
        """A buffer of `numel` elements, zero-filled unless the caller overwrites all of it (`zero=False`:
        [Note: staged gradients are copied, not added to zeros])."""
        stack = self._free.get((numel, dtype))
        tensor = stack.pop() if stack else fresh_empty(numel, dtype, self.device)
        self._in_use_bytes += tensor.numel() * tensor.element_size()
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return tensor.zero_() if zero else tensor

    def release(self, tensor: torch.Tensor) -> None:
        self._in_use_bytes -= tensor.numel() * tensor.element_size()
        if self.keeps:
            self._free.setdefault((tensor.numel(), tensor.dtype), []).append(tensor)

    @property
    def held_bytes(self) -> int:
        free = sum(t.numel() * t.element_size() for stack in self._free.values() for t in stack)
        return free + self._in_use_bytes

    def end_pass(self) -> None:
        """A backward is over (stage 3): free buffers are released ([Note: pooled buffers between passes])."""
        self._free.clear()

    def clear(self) -> None:
        self._free.clear()


def zero_unwritten(buffer: torch.Tensor, written: list[tuple[int, int]]) -> None:
    """[Note: staged gradients are copied, not added to zeros]
    A gradient staging buffer (a stage-2 bucket, a stage-3 unit) used to be zero-filled when acquired and each
    gradient added into it: a write of the whole buffer, then a read-add-write of every gradient, per bucket and
    per micro-step (on a 5.3M-parameter GPT at stage 3, 10 ms of fills per 0.2 s step on 2 ranks, issue 21). Now a
    gradient's first arrival is copied into its slot (later arrivals in the same staging add), and just before the
    collective the elements no gradient wrote (padding, parameters without a gradient on this rank) are zeroed.
    `written` are the (offset, numel) ranges the copies covered; everything else in `buffer` becomes 0."""
    position = 0
    for offset, numel in sorted(written):
        if offset > position:
            buffer.narrow(0, position, offset - position).zero_()
        position = max(position, offset + numel)
    if position < buffer.numel():
        buffer.narrow(0, position, buffer.numel() - position).zero_()


@dataclass
class _Inflight(Generic[T]):
    handle: Handle | None
    finish: Callable[[], None]
    item: T
    label: str


class InflightQueue(Generic[T]):
    """Reductions in flight, finished oldest first. [Note: bounded in-flight reductions] Finishing older
    collectives as new ones start returns their staging buffers to the pool during backward, so at most `limit`
    buckets' (units') worth of full gradients exist at once."""

    def __init__(self, limit: int, wait: Callable[[Handle | None, str], None]):
        self.limit = limit
        self._wait = wait
        self._items: list[_Inflight[T]] = []

    def push(self, handle: Handle | None, finish: Callable[[], None], item: T, label: str) -> list[T]:
        """Add a launched collective; returns the items finished to stay within the limit."""
        self._items.append(_Inflight(handle, finish, item, label))
        done = []
        while len(self._items) > self.limit:
            done.append(self._finish_oldest())
        return done

    def drain(self) -> list[T]:
        """Finish every collective in flight; returns their items in launch order."""
        done = []
        while self._items:
            done.append(self._finish_oldest())
        return done

    def _finish_oldest(self) -> T:
        entry = self._items.pop(0)
        self._wait(entry.handle, entry.label)
        entry.finish()
        return entry.item


def wait_plain(handle: Handle | None, label: str) -> None:
    if handle is not None:
        handle.wait()
