"""Bytes communicated, measured the same way for every framework: a dispatch mode over c10d ops.

[Note: measuring communication]
DDP's reducer, FSDP2, DeepSpeed and zeroshard all end in torch.distributed's c10d operators
(`c10d.allreduce_`, `c10d._allgather_base_`, ...), which pass through the dispatcher. A
`TorchDispatchMode` sees each one with its tensors, so one counter measures all four frameworks.
The mode slows every operator a little, so it is active only during one warm-up step, never during
timed steps. Bytes use the ring model zeroshard's `CommStats` uses ("bus bytes" per rank): an
all-reduce of S bytes counts 2·S·(N-1)/N; all-gather (S = output), reduce-scatter (S = input) and
broadcast count S·(N-1)/N.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, Sequence) and not isinstance(x, str):
        return sum(_bytes(item) for item in x)
    return 0


def _first(args: Sequence[Any]) -> int:
    return _bytes(args[0]) if args else 0


def _second(args: Sequence[Any]) -> int:
    return _bytes(args[1]) if len(args) > 1 else 0


# c10d op name -> (kind, full message size S in bytes from the op's arguments, ring factor in units of (N-1)/N)
_OPS: dict[str, tuple[str, Callable[[Sequence[Any]], int], float]] = {
    "allreduce_": ("all_reduce", _first, 2.0),
    "allreduce_coalesced_": ("all_reduce", _first, 2.0),
    "_allgather_base_": ("all_gather", _first, 1.0),
    "allgather_": ("all_gather", _first, 1.0),
    "allgather_into_tensor_coalesced_": ("all_gather", _first, 1.0),
    "allgather_coalesced_": ("all_gather", _first, 1.0),
    "_reduce_scatter_base_": ("reduce_scatter", _second, 1.0),
    "reduce_scatter_": ("reduce_scatter", _second, 1.0),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", _second, 1.0),
    "broadcast_": ("broadcast", _first, 1.0),
    "alltoall_base_": ("all_to_all", _first, 1.0),
    "reduce_": ("reduce", _first, 1.0),
}


class CommCounter(TorchDispatchMode):
    """Counts calls and ring-model bus bytes of every c10d collective issued while active."""

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.calls: dict[str, int] = {}
        self.bus_bytes: dict[str, float] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            self._record(func.__name__.split(".")[0], args)
        return func(*args, **(kwargs or {}))

    def _record(self, name: str, args: Sequence[Any]) -> None:
        if name not in _OPS:
            return
        kind, size_of, factor = _OPS[name]
        ring = (self.world_size - 1) / self.world_size
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bus_bytes[kind] = self.bus_bytes.get(kind, 0.0) + factor * size_of(args) * ring

    @property
    def total_bus_bytes(self) -> float:
        return sum(self.bus_bytes.values())
