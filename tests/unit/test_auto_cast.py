"""`fp16.auto_cast`: the engine casts the forward's floating-point positional inputs to fp16, through lists, tuples
(named ones too) and dicts, as DeepSpeed's engine does; keyword inputs and integer tensors are left alone."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn

from zeroshard.precision.cast import inputs_to_half

Pair = namedtuple("Pair", ["a", "b"])


def _dtypes(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _dtypes(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value).__name__, [_dtypes(v) for v in value]
    return value.dtype if isinstance(value, torch.Tensor) else value


def test_inputs_to_half_casts_floating_tensors_only() -> None:
    ints, floats = torch.arange(3), torch.ones(2, dtype=torch.float64)
    value = (floats, ints, [floats, 3.5], {"x": floats, "i": ints}, Pair(floats, ints), "s")
    out = inputs_to_half(value)
    assert _dtypes(out) == (
        "tuple",
        [
            torch.float16,
            torch.int64,
            ("list", [torch.float16, 3.5]),
            {"x": torch.float16, "i": torch.int64},
            ("Pair", [torch.float16, torch.int64]),
            "s",
        ],
    )
    assert isinstance(out[4], Pair) and out[1] is ints
    assert torch.equal(out[0].float(), floats.float())


class _Seen(nn.Module):
    """Records the dtypes of each forward's inputs; computes in fp16 whatever it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.seen: list[Any] = []

    def forward(self, x: torch.Tensor, extra: dict[str, torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
        self.seen.append((_dtypes(x), _dtypes(extra), _dtypes(scale)))
        return self.linear(x.to(self.linear.weight.dtype)).float().pow(2).mean() * scale.float()


@pytest.mark.parametrize("auto_cast", [True, False])
def test_engine_casts_positional_inputs_with_auto_cast(auto_cast: bool) -> None:
    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "fp16": {"enabled": True, "auto_cast": auto_cast},
    }
    model = _Seen()
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.fp16_auto_cast() is auto_cast
    loss = engine(torch.randn(2, 4), {"m": torch.ones(2), "i": torch.arange(2)}, scale=torch.ones(()))
    engine.backward(loss)
    engine.step()
    cast = torch.float16 if auto_cast else torch.float32
    assert model.seen == [(cast, {"m": cast, "i": torch.int64}, torch.float32)]  # keywords as given
    engine.destroy()
