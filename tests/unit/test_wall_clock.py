"""[Note: wall clock breakdown]: with `wall_clock_breakdown` the engine times forward, backward (autograd and the
reductions after it) and step per micro-step and per step, logs both as DeepSpeed does, writes the step's times to
the monitors and answers `get_wall_clock_timers()`. A model that sleeps in forward and in backward gives known
lower bounds."""

from __future__ import annotations

import csv
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from helpers.config_checks import log  # noqa: F401  (fixture)

FORWARD_S, BACKWARD_S = 0.06, 0.04


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BACKWARD_S)
        return grad


class _Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_S)
        return _SlowBackward.apply(self.linear(x))


def _engine(tmp_path: Path, enabled: bool) -> Any:
    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "wall_clock_breakdown": enabled,
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
    }
    model = _Slow()
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _micro_step(engine: Any) -> None:
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()


def test_times_are_logged_per_micro_step_and_per_step_and_written_to_the_monitors(tmp_path, log):  # noqa: F811
    engine = _engine(tmp_path, enabled=True)
    _micro_step(engine)  # not a boundary: the micro-step's line only
    first = engine.get_wall_clock_timers()
    assert first["fwd_microstep"] >= FORWARD_S * 1e3 and first["bwd_inner_microstep"] >= BACKWARD_S * 1e3, first
    assert first["bwd_microstep"] >= first["bwd_inner_microstep"] + first["bwd_allreduce_microstep"], first
    assert first["fwd"] == pytest.approx(first["fwd_microstep"], abs=0.5), first  # the step's window so far
    _micro_step(engine)  # the boundary: the window's line too, and the events
    second = engine.get_wall_clock_timers()
    # reset per micro-step, summed per step (not a bound on one forward's time: a loaded machine stretches it)
    assert second["fwd"] == pytest.approx(first["fwd_microstep"] + second["fwd_microstep"], abs=1.0), second
    assert second["fwd"] > second["fwd_microstep"] >= FORWARD_S * 1e3, second
    assert second["step"] >= second["step_microstep"] > 0.0, second
    lines = [r.getMessage() for r in log.records if r.levelno == logging.INFO and r.getMessage().startswith("time")]
    assert len(lines) == 3 and lines[0].startswith("time (ms) | fwd_microstep: "), lines
    assert lines[2].startswith("time (ms) | fwd: ") and "bwd_allreduce: " in lines[2] and "step: " in lines[2], lines
    engine.destroy()  # closes the monitors: the CSV files are complete
    with open(tmp_path / "run" / "Train_Samples_elapsed_time_ms_forward.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "elapsed_time_ms_forward"] and len(rows) == 2, rows
    assert int(rows[1][0]) == 4 and float(rows[1][1]) == pytest.approx(second["fwd"]), rows  # at 4 samples
    written = {p.name for p in (tmp_path / "run").iterdir()}
    for name in ("forward", "backward", "backward_inner", "backward_allreduce", "step"):
        assert f"Train_Samples_elapsed_time_ms_{name}.csv" in written, written


def test_off_by_default_nothing_is_timed_or_logged(tmp_path, log):  # noqa: F811
    engine = _engine(tmp_path, enabled=False)
    _micro_step(engine)
    _micro_step(engine)
    assert engine.get_wall_clock_timers() == {}
    assert not [r for r in log.records if r.getMessage().startswith("time (ms)")]
    engine.destroy()
