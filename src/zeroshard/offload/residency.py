"""Whether tensors stay in memory between uses: `InMemory`, or `NvmeStateStore` (ZeRO-Infinity): optimizer state,
master weights, gradient and parameter shards kept in swap files.

An entry (a key and its tensors) keeps its Python objects and storages, so the optimizer's parameter
keys, its state dicts and every view stay valid: `evict` writes the bytes to swap files and `settle`
resizes the storages to zero; `fetch` resizes them back and reads the bytes in, `ready` waits for that.
`drop` frees an entry whose disk copy is current (a parameter shard read for a gather), `claim` makes one
resident without reading it (a shard about to be overwritten by the optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from zeroshard.offload.host_memory import fix_mmap_threshold
from zeroshard.offload.nvme import NvmeSwapper, SwapHandle

T = TypeVar("T")


def _storage_base(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the whole storage of `tensor` (views share it: it is swapped once)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)


def _alias(base: torch.Tensor) -> torch.Tensor:
    """The same memory under another storage object: the swapper's zero-copy path exposes its tensor to
    numpy, which marks that storage non-resizable for good, and ours must stay resizable."""
    return torch.from_dlpack(base)


@dataclass
class _Entry:
    bases: list[torch.Tensor] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # swap-file key of each base (stable when others leave)
    created: int = 0
    pending: list[SwapHandle] = field(default_factory=list)
    resident: bool = True
    on_disk: bool = False  # a complete copy was written (the files exist)


class Residency:
    """Whether an entry's tensors stay in memory between uses. This base keeps them where they are (every call is
    a no-op); `NvmeStateStore` swaps them. The stepping and holding patterns (`in_turn`, `resident`) are written
    once, here, in terms of the calls."""

    leaves_memory = False  # entries live in swap files between uses: checkpoints handle them part by part
    _holding = False

    @property
    def resident_bytes(self) -> int:
        """Bytes of entries in memory now (that would otherwise be on disk)."""
        return 0

    @property
    def disk_bytes(self) -> int:
        """Bytes in swap files."""
        return 0

    def place(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        """Put `tensors` under `key` and out of memory (construction)."""

    def evict(self, key: str, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Start moving `key` (and `tensors` joining it) out of memory; `settle` finishes."""

    def settle(self, key: str) -> None:
        """Wait for `key`'s writes and release its memory."""

    def fetch(self, key: str) -> None:
        """Start bringing `key` back; `ready` waits for it."""

    def claim(self, key: str) -> None:
        """Make `key` resident without reading it (the caller overwrites every byte)."""

    def drop(self, key: str) -> None:
        """Free `key`, whose bytes are unchanged since it was read."""

    def ready(self, key: str) -> None:
        """Wait until `key` is in memory."""

    def is_resident(self, key: str) -> bool:
        return True

    def in_turn(self, keyed: Sequence[tuple[str, T]], tensors_of: Callable[[T], Sequence[torch.Tensor]]) -> Iterator[T]:
        """Yield each item with its tensors resident: item k+1 is read while k is worked on, k is written back
        when the caller moves on, k-1's memory is freed once written (at most three entries in memory)."""
        if keyed:
            self.fetch(keyed[0][0])
        for k, (key, item) in enumerate(keyed):
            self.ready(key)
            if k > 0:
                self.settle(keyed[k - 1][0])
            if k + 1 < len(keyed):
                self.fetch(keyed[k + 1][0])
            yield item
            self.evict(key, tensors_of(item))
        if keyed:
            self.settle(keyed[-1][0])

    @contextmanager
    def resident(
        self,
        keyed: Sequence[tuple[str, T]],
        tensors_of: Callable[[T], Sequence[torch.Tensor]],
        write_back: bool = True,
    ) -> Iterator[None]:
        """Every entry in memory for the block (checkpoints), written back (unless the block only reads them:
        `write_back=False`) and freed after it. Nested blocks (a checkpoint load that publishes parameters) leave
        the outermost one in charge."""
        if self._holding:
            yield
            return
        self._holding = True
        for key, _ in keyed:
            self.fetch(key)
        for key, _ in keyed:
            self.ready(key)
        try:
            yield
        finally:
            for key, item in keyed:
                if write_back:
                    self.evict(key, tensors_of(item))
                else:
                    self.drop(key)
            for key, _ in keyed:
                self.settle(key)
            self._holding = False

    def close(self) -> None:
        """Release what the residency holds (swap files)."""


class InMemory(Residency):
    """Tensors that stay where they are (device or host memory): no I/O."""


class NvmeStateStore(Residency):
    leaves_memory = True

    def __init__(self, swapper: NvmeSwapper):
        self.swapper = swapper
        self._entries: dict[str, _Entry] = {}
        self._holding = False
        fix_mmap_threshold()  # freed entries must leave the process: [Note: glibc's mmap threshold]

    def _collect(self, key: str, tensors: Sequence[torch.Tensor], complete: bool = False) -> _Entry:
        """Add the storages of `tensors` the entry does not hold yet (optimizer state after a first step).
        `complete`: `tensors` are all the entry's tensors now; storages no tensor uses any more (optimizer state
        replaced by a checkpoint load) leave the entry and their files are deleted."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        live = {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}
        if complete:
            keep = [i for i, b in enumerate(entry.bases) if b.untyped_storage().data_ptr() in live]
            for i in set(range(len(entry.bases))) - set(keep):
                self.swapper.remove(entry.files[i])
            entry.bases = [entry.bases[i] for i in keep]
            entry.nbytes = [entry.nbytes[i] for i in keep]
            entry.files = [entry.files[i] for i in keep]
        seen = {b.untyped_storage().data_ptr() for b in entry.bases if b.untyped_storage().nbytes()}
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            entry.bases.append(_storage_base(t))
            entry.nbytes.append(storage.nbytes())
            entry.files.append(f"{key}/{entry.created}")
            entry.created += 1
        return entry

    def place(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        """Write `tensors` out now and free their memory (initial placement). Tensors may join an entry
        already on disk one call at a time, so that construction never holds a whole entry in memory."""
        entry = self._entries.get(key)
        if entry is None or entry.resident:
            self.evict(key, tensors)
            self.settle(key)
            return
        first = len(entry.bases)
        self._collect(key, tensors)
        for i in range(first, len(entry.bases)):
            self.swapper.swap_out(entry.files[i], _alias(entry.bases[i])).wait()
            entry.bases[i].untyped_storage().resize_(0)

    def evict(self, key: str, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Start writing `tensors` (and what was fetched under `key`) out; `settle` frees their memory.
        An entry that is not resident is already on disk (or being written): nothing to do."""
        existing = self._entries.get(key)
        if existing is not None and not existing.resident:
            return
        if existing is not None:
            self._wait(existing)
        entry = self._collect(key, tensors, complete=bool(tensors))
        entry.pending = [self.swapper.swap_out(f, _alias(b)) for f, b in zip(entry.files, entry.bases, strict=True)]
        entry.resident = False
        entry.on_disk = True

    def settle(self, key: str) -> None:
        """Wait for `key`'s writes and release its memory."""
        entry = self._entries.get(key)
        if entry is None or entry.resident:
            return
        self._wait(entry)
        for base in entry.bases:
            base.untyped_storage().resize_(0)

    def _resize_back(self, entry: _Entry) -> None:
        for base, nbytes in zip(entry.bases, entry.nbytes, strict=True):
            base.untyped_storage().resize_(nbytes)
            base.set_(base.untyped_storage())

    def fetch(self, key: str) -> None:
        """Start reading `key` back into its (re-sized) storages; `ready` waits for it."""
        entry = self._entries.get(key)
        if entry is None or entry.resident:
            return
        self.settle(key)
        self._resize_back(entry)
        entry.pending = [self.swapper.swap_in(f, _alias(b)) for f, b in zip(entry.files, entry.bases, strict=True)]
        entry.resident = True

    def claim(self, key: str) -> None:
        """Make `key` resident without reading it: the caller overwrites every byte before the next `evict`."""
        entry = self._entries.get(key)
        if entry is None or entry.resident:
            return
        self.settle(key)
        self._resize_back(entry)
        entry.resident = True

    def drop(self, key: str) -> None:
        """Free a resident entry whose bytes are unchanged since it was read: the disk copy stays current."""
        entry = self._entries.get(key)
        if entry is None or not entry.resident or not entry.on_disk:
            return
        self._wait(entry)
        for base in entry.bases:
            base.untyped_storage().resize_(0)
        entry.resident = False

    def ready(self, key: str) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            self._wait(entry)

    def is_resident(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is None or entry.resident

    @staticmethod
    def _wait(entry: _Entry) -> None:
        for handle in entry.pending:
            handle.wait()
        entry.pending = []

    @property
    def resident_bytes(self) -> int:
        return sum(sum(e.nbytes) for e in self._entries.values() if e.resident)

    @property
    def disk_bytes(self) -> int:
        return sum(sum(e.nbytes) for e in self._entries.values())

    def close(self) -> None:
        for key in list(self._entries):
            self.ready(key)
        self.swapper.close()
