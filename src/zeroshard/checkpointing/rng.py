"""Megatron's model-parallel RNG tracker, as `deepspeed.checkpointing` provides it.

Two random streams: the default one (the same on model-parallel ranks, e.g. dropout outside tensor-parallel
regions) and named ones forked for model-parallel regions (`with get_cuda_rng_tracker().fork(): ...`). A
checkpoint saves and restores the tracker's states with the default ones, so a recompute draws the same numbers.
On a machine without CUDA the tracker forks the CPU generator.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"


def device_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named RNG states: `add(name, seed)` creates one, `fork(name)` runs a block with it and keeps its advance."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name!r} already exists")
        self.seeds_.add(seed)
        original = device_rng_state()
        torch.cuda.manual_seed(seed) if torch.cuda.is_available() else torch.manual_seed(seed)
        self.states_[name] = device_rng_state()
        set_device_rng_state(original)

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} is not added")
        original = device_rng_state()
        set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = device_rng_state()
            set_device_rng_state(original)


def seed_model_parallel(tracker: CudaRNGStatesTracker, seed: int, tp_rank: int) -> None:
    """Megatron's scheme: the default stream gets `seed`, the model-parallel one `seed + 2718 + tp_rank`."""
    tracker.reset()
    torch.cuda.manual_seed(seed) if torch.cuda.is_available() else torch.manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)


def capture(tracker: CudaRNGStatesTracker, device: torch.device | None) -> tuple[Any, ...]:
    """Every RNG state a checkpointed function may draw from: the CPU's, `device`'s (the CUDA device its inputs are
    on: the recompute runs on autograd's thread for that device, whatever the forward's current device was), the
    tracker's."""
    cuda = torch.cuda.get_rng_state(device) if device is not None else None
    return (torch.get_rng_state(), (device, cuda), tracker.get_states())


def restore(tracker: CudaRNGStatesTracker, states: tuple[Any, ...]) -> None:
    cpu, (device, cuda), named = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
    tracker.set_states(named)
