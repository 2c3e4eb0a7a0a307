"""Output asked for by name is shown whatever the log level ([Note: reports the log level does not hide]):
`deepspeed.comm.log_summary()`'s table, the wall-clock breakdown's lines and the FLOPs profile, under ds_config
`log_level: "warning"`, as DeepSpeed prints them."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from zeroshard.utils.logging import get_logger, set_log_level_from_string


@pytest.fixture
def warning_level() -> Iterator[io.StringIO]:
    """zeroshard's logger and handlers at WARNING (what `log_level: "warning"` sets), one more handler read here."""
    package = get_logger()
    before = (package.level, [(h, h.level) for h in package.handlers])
    stream = io.StringIO()
    package.addHandler(logging.StreamHandler(stream))
    set_log_level_from_string("warning")
    try:
        yield stream
    finally:
        package.handlers = [h for h, _ in before[1]]
        package.setLevel(before[0])
        for handler, level in before[1]:
            handler.setLevel(level)


def test_report_passes_the_level_on_its_ranks(warning_level: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroshard.reporting import report

    monkeypatch.setenv("RANK", "0")
    get_logger("zeroshard.test").info("an ordinary info line")
    report("asked for")
    report("not this rank's", ranks=[1])
    report("every rank's", ranks=None)
    assert warning_level.getvalue().splitlines() == ["asked for", "every rank's"]


def test_comms_log_summary_table_under_log_level_warning(warning_level: io.StringIO) -> None:
    import zeroshard
    from zeroshard.comm.comms_logger import CommsLogger
    from zeroshard.config.monitor import CommsLoggerConfig

    comms = CommsLogger(CommsLoggerConfig(enabled=True), world_size=2, rank=0)
    comms.append("all_reduce", 2.0, 4096)
    zeroshard.comm.log_summary()
    text = warning_level.getvalue()
    assert "Comm. Op" in text and "all_reduce" in text and "4.0 KB" in text
    del comms


def test_wall_clock_lines_under_log_level_warning(warning_level: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroshard.monitor.wall_clock import WallClock

    monkeypatch.setenv("RANK", "0")
    clock = WallClock(True, torch.device("cpu"))
    with clock.time("fwd"):
        pass
    clock.after_step(boundary=True, samples=2, write=lambda events: None)
    lines = warning_level.getvalue().splitlines()
    assert len(lines) == 2  # the micro-step's line, then the window's on the boundary
    assert lines[0].startswith("time (ms) | fwd_microstep: ") and lines[1].startswith("time (ms) | fwd: ")


def test_flops_profile_under_log_level_warning(warning_level: io.StringIO) -> None:
    from zeroshard.profiling.flops_profiler import get_model_profile

    get_model_profile(nn.Sequential(nn.Linear(8, 4)), input_shape=(2, 8))
    assert "DeepSpeed Flops Profiler" in warning_level.getvalue()
    assert "Flops profiler started" not in warning_level.getvalue()  # DeepSpeed logs these at INFO: hidden
