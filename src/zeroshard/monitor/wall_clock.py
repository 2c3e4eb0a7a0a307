"""DeepSpeed's `wall_clock_breakdown`: how long forward, backward and step take, per micro-step and per step.

[Note: wall clock breakdown]
As DeepSpeed 0.19.8's engine does with `"wall_clock_breakdown": true`: `engine.forward` is timed as `fwd`,
`engine.backward` as `bwd`, split into `bwd_inner` (autograd, with the reductions it launches) and `bwd_allreduce`
(what is left to reduce once autograd returns), and `engine.step` as `step`. Each is a micro timer
(`fwd_microstep`, ...) that rank 0 logs and resets after every `engine.step()`; their sums over the accumulation
window (`fwd`, ...) it logs and resets on every boundary, after writing them to the monitors as
`Train/Samples/elapsed_time_ms_forward`, `..._backward`, `..._backward_inner`, `..._backward_allreduce` and
`..._step`; the lines are shown whatever the log level, as DeepSpeed prints them ([Note: reports the log level
does not hide]). `engine.get_wall_clock_timers()` is
the snapshot taken before those resets. Times are milliseconds summed over the window: on CUDA between events
recorded on the current stream (the device's time; reading them synchronizes, as DeepSpeed's do), elsewhere the
host's. The pipeline engine times only `step`: torch's schedule runs forward and backward inside `train_batch`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zeroshard.monitor.base import Event
from zeroshard.reporting import report

EVENT_NAMES = {  # timer -> its monitor event's suffix
    "fwd": "forward",
    "bwd": "backward",
    "bwd_inner": "backward_inner",
    "bwd_allreduce": "backward_allreduce",
    "step": "step",
}


class _Timer:
    """Spans summed until reset: device events on CUDA, host time elsewhere."""

    def __init__(self, device: torch.device):
        self._events = device.type == "cuda"
        self._spans: list[tuple[Any, Any]] = []
        self._start: Any = None

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        self._spans.append((self._start, self._now()))
        self._start = None

    def elapsed_ms(self) -> float:
        if not self._events:
            return sum(end - start for start, end in self._spans) * 1e3
        return sum(span_ms(start, end, True) for start, end in self._spans)

    def reset(self) -> None:
        self._spans.clear()

    def _now(self) -> Any:
        return mark(self._events)


def mark(events: bool) -> Any:
    """Now: a recorded CUDA event (`events`), else the host clock."""
    if not events:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def span_ms(start: Any, end: Any, events: bool) -> float:
    """Milliseconds between two `mark`s (events: the device's time, once its work up to `end` is done)."""
    if not events:
        return float((end - start) * 1e3)
    end.synchronize()
    return float(start.elapsed_time(end))


class WallClock:
    """The engine's timers ([Note: wall clock breakdown]); does nothing unless `enabled`."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled
        self._timers = {name: _Timer(device) for name in EVENT_NAMES}  # the micro-step's spans
        self._window = dict.fromkeys(EVENT_NAMES, 0.0)  # the step's milliseconds: its micro-steps' sums
        self._snapshot: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Time the block as `name` (a key of EVENT_NAMES)."""
        if not self.enabled:
            yield
            return
        timer = self._timers[name]
        timer.start()
        try:
            yield
        finally:
            timer.stop()

    def after_step(self, boundary: bool, samples: int, write: Callable[[list[Event]], None]) -> None:
        """The end of `engine.step()`: log the micro-step's times; on a boundary also the step's, and write them."""
        if not self.enabled:
            return
        micro = {name: timer.elapsed_ms() for name, timer in self._timers.items()}
        for name, timer in self._timers.items():
            self._window[name] += micro[name]
            timer.reset()
        window = dict(self._window)
        microsteps = {f"{name}_microstep": ms for name, ms in micro.items()}
        self._snapshot = {**microsteps, **window}
        report(_line(microsteps))  # [Note: reports the log level does not hide]
        if boundary:
            write([(f"Train/Samples/elapsed_time_ms_{EVENT_NAMES[name]}", ms, samples) for name, ms in window.items()])
            report(_line(window))
            self._window = dict.fromkeys(EVENT_NAMES, 0.0)

    def snapshot(self) -> dict[str, float]:
        """DeepSpeed's `engine.get_wall_clock_timers()`: every timer's milliseconds at the last `engine.step()`."""
        return dict(self._snapshot)


def _line(times: dict[str, float]) -> str:
    return "time (ms) | " + " | ".join(f"{name}: {ms:.2f}" for name, ms in times.items())
