"""Measuring activation memory without a GPU: the bytes autograd keeps for backward.

[Note: measuring activation memory] On CPU there is no allocator counter to read, and process RSS mixes in
everything else. What activation checkpointing changes is what autograd keeps between forward and backward,
so we count exactly that: a saved-tensors hook sees every tensor an op saves for backward and sums the bytes
of their distinct storages, leaving out the parameters' (model states, not activations). Checkpointed inputs
that `zeroshard.checkpointing` keeps outside autograd are in `checkpointing.stats()`; a tensor
`torch.utils.checkpoint` keeps is a saved tensor too, so it is counted here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class SavedBytes:
    storages: dict[int, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


@contextmanager
def saved_activation_bytes(model: nn.Module) -> Iterator[SavedBytes]:
    """Sum the bytes of distinct non-parameter storages autograd saves inside the block."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = SavedBytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes() > 0:
            seen.storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen
