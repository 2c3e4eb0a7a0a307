"""Per-rank RNG states (torch CPU and CUDA, numpy, python) as JSON, for exact resume."""

from __future__ import annotations

import base64
import random
from typing import Any, cast

import numpy as np
import torch


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict[str, Any]:
    """Every generator a training step may draw from, on this rank."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = cast(tuple[str, Any, int, int, float], np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _encode(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # the rank's own generator (its current device), restored onto the rank's device whatever the node layout
        # of the run that loads it; every device's by index, as before, put rank 5's state of cuda:5 on cuda:1 of
        # a 2x4 resume, and nothing where another count of GPUs was visible
        state["cuda_device"] = _encode(torch.cuda.get_rng_state(torch.cuda.current_device()))
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the generators to `state` (from capture_rng_state, possibly in another process)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_decode(state["torch"]))
    if "cuda_device" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_decode(state["cuda_device"]), torch.cuda.current_device())
    elif "cuda" in state and torch.cuda.is_available():  # a checkpoint of an earlier release: every device's
        saved = [_decode(s) for s in state["cuda"]]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
