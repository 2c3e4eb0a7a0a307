"""`deepspeed.utils.timer`: `SynchronizedWallClockTimer` (named timers a script starts and stops itself, Megatron's
`timers("fwd").start()`) and `ThroughputTimer` with DeepSpeed's constructor, over the engine's
throughput timer (`monitor/throughput.py`, [Note: throughput timer]).

Example:
    >>> timers = SynchronizedWallClockTimer()
    >>> timers("fwd").start()
    >>> timers("fwd").stop()
    >>> timers.log(["fwd"])  # "time (ms) | fwd: 0.01", logged on rank 0
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from zeroshard.accelerator import get_accelerator
from zeroshard.monitor.throughput import ThroughputTimer as _EngineThroughputTimer
from zeroshard.monitor.wall_clock import mark, span_ms
from zeroshard.utils.logging import get_logger, log_dist

logger = get_logger(__name__)

# the engine's timer names (DeepSpeed's constants; `engine.get_wall_clock_timers()` keys)
FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
TIME_EPSILON = 1e-6
_GIB = 1024**3


class _NamedTimer:
    """One timer of the group: the spans between its starts and stops, in milliseconds (CUDA events on a CUDA
    device, the host clock elsewhere, as DeepSpeed's accelerator chooses)."""

    def __init__(self, name: str) -> None:
        self.name_ = name
        self.started_ = False
        self._events = get_accelerator().device_name() == "cuda"
        self._start: Any = None
        self._spans: list[tuple[Any, Any]] = []
        self.elapsed_records: list[float] | None = None

    def start(self) -> None:
        if self.started_:
            raise RuntimeError(f"timer {self.name_!r} has already been started")
        self._start = self._now()
        self.started_ = True

    def stop(self, reset: bool = False, record: bool = False) -> None:
        """End the running span (`reset` and `record` are accepted and unused, as in DeepSpeed)."""
        if not self.started_:
            raise RuntimeError(f"timer {self.name_!r} is not started")
        self._spans.append((self._start, self._now()))
        self._start = None
        self.started_ = False

    def reset(self) -> None:
        self.started_ = False
        self.elapsed_records = None
        self._start = None
        self._spans.clear()

    def elapsed(self, reset: bool = True) -> float:
        """Milliseconds of the spans so far (a running one counted up to now and kept running); `reset` clears."""
        running = self.started_
        if running:
            self.stop()
        self.elapsed_records = [self._span_ms(start, end) for start, end in self._spans]
        total = sum(self.elapsed_records)
        if reset:
            self.reset()
        if running:
            self.start()
        return total

    def mean(self) -> float:
        """The spans' mean in milliseconds, the shortest and longest 10% left out (DeepSpeed's trimmed mean)."""
        self.elapsed(reset=False)
        return _trimmed_mean(self.elapsed_records or [], 0.1)

    def _now(self) -> Any:
        return mark(self._events)

    def _span_ms(self, start: Any, end: Any) -> float:
        return span_ms(start, end, self._events)  # the device's time, as DeepSpeed's event timers


class SynchronizedWallClockTimer:
    """DeepSpeed's group of named timers: `timers(name)` makes or returns one (`start()`, `stop()`, `elapsed()`,
    `reset()`, `mean()`); `log(names)` logs their milliseconds on the given ranks (rank 0 by default)."""

    Timer = _NamedTimer

    def __init__(self) -> None:
        self.timers: dict[str, _NamedTimer] = {}

    def __call__(self, name: str) -> _NamedTimer:
        if name not in self.timers:
            self.timers[name] = _NamedTimer(name)
        return self.timers[name]

    def get_timers(self) -> dict[str, _NamedTimer]:
        return self.timers

    @staticmethod
    def memory_usage() -> str:
        acc = get_accelerator()
        return (
            f" | mem_allocated: {acc.memory_allocated() / _GIB:.4f} GB"
            f" | max_mem_allocated: {acc.max_memory_allocated() / _GIB:.4f} GB"
            f" | cache_allocated: {acc.memory_reserved() / _GIB:.4f} GB"
            f" | max_cache_allocated: {acc.max_memory_reserved() / _GIB:.4f} GB"
        )

    def log(
        self,
        names: Iterable[str],
        normalizer: float = 1.0,
        reset: bool = True,
        memory_breakdown: bool = False,
        ranks: list[int] | None = None,
    ) -> None:
        """Log `time (ms) | name: ms | ...` for the named timers that exist, each divided by `normalizer`
        (`memory_breakdown` is accepted and unused, as in DeepSpeed). Logged, where DeepSpeed prints."""
        if normalizer <= 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        parts = [f"{n}: {self.timers[n].elapsed(reset=reset) / normalizer:.2f}" for n in names if n in self.timers]
        log_dist(" | ".join(["time (ms)", *parts]), ranks=ranks or [0])

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """Each named timer's trimmed mean, times 1000 and divided by `normalizer`: DeepSpeed's arithmetic, which
        scales the milliseconds of `mean()` by 1000 again (`reset` is accepted and unused, as there)."""
        if normalizer <= 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        return {n: self.timers[n].mean() * 1000.0 / normalizer for n in names if n in self.timers}


class ThroughputTimer(_EngineThroughputTimer):
    """DeepSpeed's constructor for the throughput timer ([Note: throughput timer]): `config` is anything with
    `enabled` and `synchronized` (DeepSpeed's `DeepSpeedThroughputTimerConfig`, zeroshard's `ThroughputTimerConfig`);
    `monitor_memory` adds a line of the host's memory and swap use (needs psutil); `logging_fn` takes each line
    (default: zeroshard's logger, on the calling rank). The engine's `tput_timer` is the base class, so
    `isinstance(engine.tput_timer, ThroughputTimer)` does not hold.

    Example:
        >>> from types import SimpleNamespace
        >>> timer = ThroughputTimer(SimpleNamespace(enabled=True, synchronized=False), batch_size=8)
        >>> timer.start(); timer.stop(global_step=True)
    """

    def __init__(
        self,
        config: Any,
        batch_size: int | None,
        start_step: int = 2,
        steps_per_output: int | None = None,
        monitor_memory: bool = False,
        logging_fn: Callable[[str], Any] | None = None,
    ) -> None:
        super().__init__(
            enabled=bool(config.enabled),
            synchronized=bool(config.synchronized),
            batch_size=1 if batch_size is None else batch_size,
            steps_per_output=steps_per_output,
            start_step=start_step,
        )
        self.config = config
        if monitor_memory:
            try:
                import psutil  # noqa: F401
            except ImportError as error:
                raise ImportError("ThroughputTimer(monitor_memory=True) needs psutil: pip install psutil") from error
        self.monitor_memory = monitor_memory
        self.logging = logging_fn

    def _report(self, message: str) -> None:
        self._emit(message)
        if self.monitor_memory:
            import psutil

            memory, swap = psutil.virtual_memory().percent, psutil.swap_memory().percent
            self._emit(f"{self._position()}, vm %: {memory}, swap %: {swap}")

    def _emit(self, line: str) -> None:
        if self.logging is None:
            logger.info(line)  # on the calling rank, as DeepSpeed's `logger.info`
        else:
            self.logging(line)


def _trimmed_mean(data: list[float], trim: float) -> float:
    if not data:
        return 0.0
    ordered = sorted(data)
    k = int(round(len(ordered) * trim))
    kept = ordered[k : len(ordered) - k]
    return sum(kept) / len(kept)


__all__ = [
    "BACKWARD_GLOBAL_TIMER",
    "BACKWARD_INNER_GLOBAL_TIMER",
    "BACKWARD_INNER_MICRO_TIMER",
    "BACKWARD_MICRO_TIMER",
    "BACKWARD_REDUCE_GLOBAL_TIMER",
    "BACKWARD_REDUCE_MICRO_TIMER",
    "FORWARD_GLOBAL_TIMER",
    "FORWARD_MICRO_TIMER",
    "STEP_GLOBAL_TIMER",
    "STEP_MICRO_TIMER",
    "SynchronizedWallClockTimer",
    "TIME_EPSILON",
    "ThroughputTimer",
]
