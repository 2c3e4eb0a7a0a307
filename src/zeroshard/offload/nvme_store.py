"""Optimizer tensors kept on NVMe between uses (ZeRO-Infinity's optimizer offload).

A sub-group's tensors (fp32 master shards and elementwise optimizer state) keep their Python objects
and storages, so the optimizer's parameter keys, its state dicts and every view stay valid: `evict`
writes the bytes to swap files and resizes the storages to zero; `fetch` resizes them back and reads
the bytes in. The strategy fetches sub-group k+1 while it steps sub-group k and evicts k afterwards
(`sub_group_size` bounds what is resident).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from zeroshard.offload.nvme import NvmeSwapper, SwapHandle


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
    pending: list[SwapHandle] = field(default_factory=list)
    resident: bool = True


class NvmeStateStore:
    def __init__(self, swapper: NvmeSwapper):
        self.swapper = swapper
        self._entries: dict[str, _Entry] = {}

    def _collect(self, key: str, tensors: Sequence[torch.Tensor]) -> _Entry:
        entry = self._entries.get(key)
        seen = {b.untyped_storage().data_ptr() for b in entry.bases} if entry else set()
        if entry is None:
            entry = self._entries[key] = _Entry()
        for t in tensors:  # tensors created since the last eviction (optimizer state after a first step)
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            entry.bases.append(_storage_base(t))
            entry.nbytes.append(storage.nbytes())
        return entry

    def evict(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        """Start writing `tensors` (and what was fetched under `key`) out; `settle` frees their memory."""
        entry = self._collect(key, tensors)
        self._wait(entry)
        entry.pending = [self.swapper.swap_out(f"{key}/{i}", _alias(base)) for i, base in enumerate(entry.bases)]
        entry.resident = False

    def settle(self, key: str) -> None:
        """Wait for `key`'s writes and release its memory."""
        entry = self._entries.get(key)
        if entry is None or entry.resident:
            return
        self._wait(entry)
        for base in entry.bases:
            base.untyped_storage().resize_(0)

    def fetch(self, key: str) -> None:
        """Start reading `key` back into its (re-sized) storages; `ready` waits for it."""
        entry = self._entries.get(key)
        if entry is None or entry.resident:
            return
        self.settle(key)
        for base, nbytes in zip(entry.bases, entry.nbytes, strict=True):
            base.untyped_storage().resize_(nbytes)
            base.set_(base.untyped_storage())
        entry.pending = [self.swapper.swap_in(f"{key}/{i}", _alias(base)) for i, base in enumerate(entry.bases)]
        entry.resident = True

    def ready(self, key: str) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            self._wait(entry)

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
