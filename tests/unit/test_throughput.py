"""[Note: throughput timer]: `timers.throughput` (on by default) logs DeepSpeed's samples-per-second line every
`steps_per_print` steps from the third step on; `memory_breakdown` logs DeepSpeed's six memory lines per
micro-step; `dump_state` logs the engine's attributes at initialize. A model that sleeps in forward gives known
bounds on the rates."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import pytest
import torch
from torch import nn

from helpers.config_checks import log  # noqa: F401  (fixture)

FORWARD_S = 0.05
MICRO, GAS = 2, 2


class _Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_S)
        return self.linear(x).pow(2).mean()


def _engine(**extra: Any) -> Any:
    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        **extra,
    }
    model = _Slow()
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(engine: Any, steps: int) -> None:
    for _ in range(steps * GAS):
        engine.backward(engine(torch.randn(MICRO, 4)))
        engine.step()


def _messages(log: Any, pattern: str) -> list[str]:  # noqa: F811
    return [r.getMessage() for r in log.records if r.levelno == logging.INFO and re.search(pattern, r.getMessage())]


def test_throughput_is_logged_every_steps_per_print_from_the_third_step(log) -> None:  # noqa: F811
    engine = _engine()
    _train(engine, 6)
    lines = _messages(log, r"^epoch=")
    # steps 1-2 are not timed (start_step 2), so step 2 has nothing to report: steps 4 and 6 do
    assert [re.search(r"global_step=(\d+),", line).group(1) for line in lines] == ["4", "6"], lines  # type: ignore
    assert lines[0].startswith("epoch=0/micro_step=8/global_step=4, RunningAvgSamplesPerSec="), lines
    batch = MICRO * GAS  # train_batch_size on one rank
    current = float(re.search(r"CurrSamplesPerSec=([0-9.]+)", lines[1]).group(1))  # type: ignore[union-attr]
    assert 0 < current < batch / (GAS * FORWARD_S), current  # two sleeping forwards per step
    average = engine.tput_timer.avg_samples_per_sec()
    assert 0 < average < batch / (GAS * FORWARD_S), average
    assert "MemAllocated=" in lines[1] and "MaxMemAllocated=" in lines[1]
    engine.destroy()


def test_windows_the_script_ends_are_timed_whole_with_their_samples(log) -> None:  # noqa: F811
    """managed_gradient_accumulation false: windows of 3 micro-batches (gas 2) are timed from their first forward and
    count 3 micro-batches each; timing only the last forward, or counting train_batch_size, would report about twice
    the bound."""
    engine = _engine(managed_gradient_accumulation=False)
    for _ in range(6):
        for _ in range(3):
            engine.backward(engine(torch.randn(MICRO, 4)))
        engine.step()
    lines = _messages(log, r"^epoch=")
    assert [re.search(r"global_step=(\d+),", line).group(1) for line in lines] == ["4", "6"], lines  # type: ignore
    window = 3 * MICRO
    current = float(re.search(r"CurrSamplesPerSec=([0-9.]+)", lines[1]).group(1))  # type: ignore[union-attr]
    assert 0 < current < window / (3 * FORWARD_S), current
    assert 0 < engine.tput_timer.avg_samples_per_sec() < window / (3 * FORWARD_S)
    assert engine.tput_timer.total_samples == 4 * window  # steps 3-6 are timed
    engine.destroy()


def test_throughput_off_logs_nothing(log) -> None:  # noqa: F811
    engine = _engine(timers={"throughput": {"enabled": False}})
    _train(engine, 4)
    assert not _messages(log, r"^epoch=") and engine.tput_timer.avg_samples_per_sec() == float("-inf")
    engine.destroy()


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by the throughput lines: the other tests
# of this file
@pytest.mark.slow
def test_memory_breakdown_logs_six_lines_per_micro_step(log) -> None:  # noqa: F811
    engine = _engine(memory_breakdown=True)
    _train(engine, 1)
    lines = _messages(log, r"^Engine (before|after) ")
    names = [line.split(" | ")[0] for line in lines]
    one = [f"Engine {when} {what}" for what in ("forward", "backward", "step") for when in ("before", "after")]
    assert names == one * GAS, names
    assert all(" | MA " in line and " Max_MA " in line for line in lines)
    engine.destroy()
    quiet = _engine()
    log.clear()
    _train(quiet, 1)
    assert not _messages(log, r"^Engine (before|after) ")
    quiet.destroy()


@pytest.mark.parametrize("dump", [True, False])
def test_dump_state_logs_the_engines_attributes_at_initialize(log, dump: bool) -> None:  # noqa: F811
    engine = _engine(dump_state=dump)
    lines = [r.getMessage() for r in log.records]
    assert ("Engine:" in lines) is dump
    assert any(re.match(r"^  global_steps \.+ 0$", line) for line in lines) is dump
    engine.destroy()


def test_log_level_sets_zeroshards_logger_at_initialize(log) -> None:  # noqa: F811
    from zeroshard.errors import ConfigError
    from zeroshard.utils.logging import get_logger

    logger = get_logger()
    before = logger.level, [(handler, handler.level) for handler in logger.handlers]
    try:
        engine = _engine(log_level="WARNING", timers={"throughput": {"enabled": True}})
        assert logger.level == logging.WARNING
        log.clear()
        _train(engine, 4)
        assert not _messages(log, r"^epoch=")  # the throughput lines are INFO
        engine.destroy()
    finally:
        logger.setLevel(before[0])
        for handler, level in before[1]:
            handler.setLevel(level)
    with pytest.raises(ConfigError, match="log_level"):
        _engine(log_level="verbose")


def test_disable_python_gc_holds_while_an_engine_lives() -> None:
    """[Note: python gc per process]: off from the first such engine, back on when the last is destroyed or
    dropped; engines without the key leave it alone."""
    import gc

    from zeroshard.runtime.python_gc import PYTHON_GC

    assert gc.isenabled() and PYTHON_GC.engines == 0
    plain = _engine()
    assert gc.isenabled()
    first, second = _engine(disable_python_gc=True), _engine(disable_python_gc=True)
    assert not gc.isenabled() and PYTHON_GC.engines == 2
    assert first.collect_python_gc() >= 0 and not gc.isenabled()
    first.destroy()
    first.destroy()  # twice: counted once
    assert not gc.isenabled() and PYTHON_GC.engines == 1
    del second  # dropped without destroy: its finalizer releases it
    gc.collect()
    assert gc.isenabled() and PYTHON_GC.engines == 0
    plain.destroy()
