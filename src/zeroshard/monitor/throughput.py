"""DeepSpeed's throughput timer (`timers.throughput`, on by default) and `memory_breakdown`'s memory lines.

[Note: throughput timer]
As DeepSpeed 0.19.8's engine does: the timer starts at every `engine.forward` and stops at the `engine.step()`
that follows; the micro-steps' times add up to the step's, and from the third step on (`start_step` 2) they add
up to a running total. On every boundary whose step count is a multiple of `steps_per_print`, rank 0 logs
`epoch=E/micro_step=M/global_step=G, RunningAvgSamplesPerSec=..., CurrSamplesPerSec=..., MemAllocated=...GB,
MaxMemAllocated=...GB`, where the running average is train_batch_size over the mean step time since the start step
and the current one is train_batch_size over this step's time. `synchronized` waits for the device at start and
stop (what DeepSpeed does by default; off, a CUDA step may be timed before its kernels end). Where DeepSpeed made
the training dataloader it starts the timer as the loader hands out a batch instead of at forward (so its times
include loading the batch); here it always starts at forward, and `epoch` is the engine dataloader's epoch (its
sampler's), 0 without one, or the epochs the script counts with `update_epoch_count()` where it calls it.
`engine.tput_timer` is the timer, with DeepSpeed's `avg_samples_per_sec()`.
With windows the script ends ([Note: caller-owned windows]) a step follows several forwards: the timer runs from
the window's first forward to its step and counts the samples the window trained on. (DeepSpeed restarts it at
every forward and counts train_batch_size, so it reports the last micro-batch's time for the whole window.)
"""

from __future__ import annotations

import time
from typing import Any

from zeroshard.accelerator import get_accelerator
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)
_GIB = 1024**3
TIME_EPSILON = 1e-6  # DeepSpeed's guard against a zero step time


class ThroughputTimer:
    """Samples per second of training steps ([Note: throughput timer])."""

    def __init__(
        self,
        enabled: bool,
        synchronized: bool,
        batch_size: int,
        steps_per_output: int | None,
        start_step: int = 2,
        loader: Any = None,
        whole_windows: bool = False,
    ):
        self.enabled = enabled
        self.synchronized = synchronized
        self.batch_size = batch_size
        self.steps_per_output = steps_per_output
        self.start_step = start_step
        self._loader = loader
        self.whole_windows = whole_windows  # time from a window's first forward, not its last
        self.initialized = False  # started at least once (DeepSpeed's name)
        self.started = False  # between a start() and its stop()
        self.total_samples = 0  # of the steps timed since start_step
        self.start_time = 0.0  # of the running timed interval; 0 until the first step after start_step
        self.end_time = 0.0  # of the latest timed interval
        self.micro_step_count = 0
        self._epochs = 0  # counted by update_epoch_count, beyond the engine dataloader's own
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0

    @property
    def epoch_count(self) -> int:
        sampler = getattr(self._loader, "sampler", None)
        return self._epochs or int(getattr(sampler, "epoch", 0))  # the script's count where it keeps one

    def update_epoch_count(self) -> None:
        """A new epoch of the script's own loader (DeepSpeed-Chat calls this at each epoch's end): count it and
        start its micro-steps from 0, as DeepSpeed's timer does."""
        self._epochs += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.enabled or (self.started and self.whole_windows):
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            self._synchronize()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True, samples: int | None = None) -> None:
        """End a micro-step (`global_step`: it ended an optimizer step, DeepSpeed's defaults); `samples`: what the
        step trained on (default train_batch_size)."""
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return
        self._synchronize()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        step_samples = self.batch_size if samples is None else samples
        self.total_samples += step_samples
        if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
            acc = get_accelerator()
            self._report(
                f"{self._position()}, "
                f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                f"CurrSamplesPerSec={step_samples / (self.step_elapsed_time + TIME_EPSILON)}, "
                f"MemAllocated={round(acc.memory_allocated() / _GIB, 2)}GB, "
                f"MaxMemAllocated={round(acc.max_memory_allocated() / _GIB, 2)}GB"
            )
        self.step_elapsed_time = 0.0

    def _position(self) -> str:
        return f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/global_step={self.global_step_count}"

    def _report(self, message: str) -> None:
        """The speed line: logged on rank 0 (the engine asks only rank 0 to report)."""
        log_rank(logger, 20, message)

    def avg_samples_per_sec(self) -> float:
        """The samples of the steps timed since `start_step` over their time (train_batch_size over the mean step
        time, with managed windows); -inf before the first step, as DeepSpeed's, and until a step has been timed
        (DeepSpeed raises ZeroDivisionError from its first step to `start_step`, which its log never reaches)."""
        steps = self.global_step_count - self.start_step
        if steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.total_samples / self.total_elapsed_time

    def _synchronize(self) -> None:
        if self.synchronized:
            get_accelerator().synchronize()
