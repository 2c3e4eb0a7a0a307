"""Measuring activation memory without a GPU: the bytes autograd keeps for backward.

[Note: measuring activation memory] On CPU there is no allocator counter to read, and process RSS mixes in
everything else. What activation checkpointing changes is what autograd keeps between forward and backward,
so we count exactly that: a saved-tensors hook sees every tensor an op saves for backward and sums the bytes
of their distinct storages, leaving out the parameters' (model states, not activations). Checkpointed inputs
that `zeroshard.checkpointing` keeps outside autograd are in `checkpointing.stats()`; a tensor
`torch.utils.checkpoint` keeps is a saved tensor too, so it is counted here.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


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


class _Tracker(TorchDispatchMode):
    """Every storage an op creates, with its lifetime (a finalizer on the storage object, which torch keeps
    unique per storage), as a timeline of (+bytes, key) and (-bytes, key)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[int, int]] = []
        self.live: set[int] = set()
        self._next = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            # a fresh allocation: not a view, not an input written in place (a parameter, an existing .grad)
            if isinstance(t, torch.Tensor) and not t._is_view() and t.untyped_storage().data_ptr() not in inputs:
                self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if getattr(storage, "_tracked_key", None) is not None or storage.nbytes() == 0:
            return
        key, self._next = self._next, self._next + 1
        storage._tracked_key = key  # type: ignore[attr-defined]
        nbytes = storage.nbytes()
        self.events.append((nbytes, key))
        self.live.add(key)
        weakref.finalize(storage, self._freed, key, nbytes)

    def _freed(self, key: int, nbytes: int) -> None:
        if key in self.live:
            self.live.discard(key)
            self.events.append((-nbytes, key))


@dataclass
class PeakBytes:
    peak: int = 0  # most bytes alive at once, parameter gradients left out
    gradients: int = 0  # bytes of parameter gradients produced (model states, not activations)


@contextmanager
def peak_activation_bytes(model: nn.Module) -> Iterator[PeakBytes]:
    """[Note: measuring activation memory] Peak of the bytes allocated inside the block (forward and backward)
    and alive at once, without the parameters' gradients: a tensor hook on each parameter names the gradient
    tensors, which are model states. Parameters, their `.grad` from before and anything allocated before the
    block are not counted."""
    tracker = _Tracker()
    result = PeakBytes()
    grads: set[int] = set()

    def on_grad(g: torch.Tensor) -> None:
        key = getattr(g.untyped_storage(), "_tracked_key", None)
        if key is not None:
            grads.add(key)
            result.gradients += g.untyped_storage().nbytes()

    handles = [p.register_hook(on_grad) for p in model.parameters() if p.requires_grad]
    try:
        with tracker:
            yield result
    finally:
        for handle in handles:
            handle.remove()
    live = 0
    for delta, key in tracker.events:
        if key in grads:
            continue
        live += delta
        result.peak = max(result.peak, live)
