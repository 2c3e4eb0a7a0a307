"""DeepSpeed's `tests/unit/runtime/half_precision/test_dynamic_loss_scale.py` with the import swapped: fp16 at
stage 0 (its FP16_Optimizer with Adam, FP16_UnfusedOptimizer with Lamb) read through `optimizer.loss_scale_config`."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import zeroshard as deepspeed
from helpers.process_group import own_process_group  # noqa: F401 (an autouse fixture)

INF, NAN = float("inf"), float("nan")


class Probe(nn.Module):
    """Every gradient element equals the input value, as DeepSpeed's test fills them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * x).sum() for p in self.parameters())


def _engine(optimizer: str, power: int, **fp16: Any) -> tuple[Any, Any]:
    config = {
        "train_batch_size": 1,
        "steps_per_print": 1,
        "optimizer": {"type": optimizer, "params": {"lr": 0.00015}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": power, "loss_scale_window": 2, **fp16},
    }
    model = Probe()
    engine, optim, _, _ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters())
    return engine, optim


def _step(engine: Any, value: float) -> None:
    engine.backward(engine(torch.tensor(value, dtype=torch.float16)))
    engine.step()


@pytest.mark.parametrize("optimizer", ["Adam", "Lamb"])
def test_no_overflow(optimizer: str) -> None:
    engine, optim = _engine(optimizer, 8)
    expected = 2**8
    assert optim.loss_scale_config.dynamic_loss_scale and optim.loss_scale_config.scale_window == 2
    assert optim.loss_scale_config.cur_scale == expected
    for i, value in enumerate(np.random.default_rng(0).uniform(-0.1, 0.1, 10)):
        _step(engine, float(value))
        assert optim.loss_scale_config.cur_scale == expected and optim.loss_scale_config.cur_iter == i + 1
        if optim.loss_scale_config.cur_iter % 2 == 0:
            expected *= 2
    engine.destroy()


@pytest.mark.parametrize(("optimizer", "floor"), [("Adam", None), ("Lamb", 2.0)])
def test_all_overflow_halves_down_to_the_floor_and_stays(optimizer: str, floor: float | None) -> None:
    engine, optim = _engine(optimizer, 4, **({"min_loss_scale": floor} if floor is not None else {}))
    expected, minimum = 2.0**4, floor or 1.0
    assert optim.loss_scale_config.min_loss_scale == minimum
    for i, value in enumerate([INF, -INF] + [NAN] * 6):  # hysteresis (2 by default) is not read at stage 0
        _step(engine, value)
        expected = max(expected / 2, minimum)
        assert optim.loss_scale_config.cur_scale == expected and optim.loss_scale_config.cur_iter == i + 1
    assert engine.skipped_steps == 8
    engine.destroy()


@pytest.mark.parametrize("optimizer", ["Adam", "Lamb"])
def test_some_overflow(optimizer: str) -> None:
    engine, optim = _engine(optimizer, 8)
    expected, seen = 2.0**8, []
    for value in [INF, NAN]:
        _step(engine, value)
        expected /= 2
        seen.append((optim.loss_scale_config.cur_scale, expected))
    for value in np.random.default_rng(1).uniform(-0.1, 0.1, 3):  # window + 1 clean steps double it once
        _step(engine, float(value))
    seen.append((optim.loss_scale_config.cur_scale, expected * 2))
    _step(engine, INF)
    seen.append((optim.loss_scale_config.cur_scale, expected))
    assert all(got == want for got, want in seen), seen
    assert optim.loss_scale_config.cur_iter == 6 and optim.loss_scale_config.last_overflow_iter == 5
    engine.destroy()
