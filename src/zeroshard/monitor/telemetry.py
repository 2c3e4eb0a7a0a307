"""What the engine tells its monitors and FLOPs profiler, at the points DeepSpeed's engine does.

[Note: monitor events] Written on rank 0, with global samples as the x-axis:
- `Train/Samples/lr` (the first parameter group's) and, with fp16, `Train/Samples/loss_scale` at the end of
  `engine.step()` on an accumulation boundary, after the step (samples counted with this step), whether the step
  was applied or skipped: DeepSpeed 0.19.8's `engine.step()`;
- `Train/Samples/train_loss`: the mean of the step's micro-batch losses, written at the boundary's
  `engine.backward()`, before the step (samples not yet counted with this step). DeepSpeed's engine wrote it there
  in earlier releases; 0.19.8 writes it from its pipeline engine only. We keep it where users' dashboards had it.
  The loss is this rank's (not averaged over ranks), as DeepSpeed logs it.
- from the pipeline engine, as DeepSpeed 0.19.8's: `Train/Samples/train_loss` at the end of `train_batch()`, after
  its step (samples counted with it), and `Train/Samples/eval_loss` at the end of `eval_batch()`; each the batch's
  loss as `train_batch`/`eval_batch` return it: the mean over the micro-batches and the data-parallel replicas.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from zeroshard.monitor.base import Event, Monitor
from zeroshard.monitor.flops import FlopsProfiler
from zeroshard.monitor.monitor import by_kind
from zeroshard.monitor.opening import monitor_blocks_enabled
from zeroshard.reporting import report
from zeroshard.zero.strategy import Strategy


class Telemetry:
    """The engine's one contact with monitors and the FLOPs profiler: it reports, this decides what to write."""

    def __init__(self, monitors: list[Monitor], profiler: FlopsProfiler | None, enabled: bool = False):
        self.enabled = enabled  # DeepSpeed's monitor.enabled: a monitor block is on (on every rank)
        self.monitors = monitors
        # DeepSpeed's MonitorMaster attributes (scripts log through `engine.monitor.tb_monitor.summary_writer`):
        # None for a disabled block and on every rank but 0
        self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor = by_kind(monitors)
        self.profiler = profiler
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0

    @classmethod
    def from_config(
        cls,
        config: Any,
        model: nn.Module,
        rank: int,
        world_size: int,
        strategy: Strategy | None,
        monitors: list[Monitor],
    ) -> Telemetry:
        """`monitors` (opened on rank 0: opening.py) and the profiler on rank 0 (DeepSpeed builds and profiles there
        only); nothing elsewhere."""
        enabled = monitor_blocks_enabled(config)
        if rank != 0:
            return cls([], None, enabled)
        profiler = None
        if config.flops_profiler.enabled:
            micro = int(config.train_micro_batch_size_per_gpu or 1)

            def shapes() -> dict[int, tuple[int, ...]]:  # stage 3's full shapes: [Note: flops profile]
                return strategy.checkpoint_state().full_shapes() if strategy is not None else {}

            profiler = FlopsProfiler(config.flops_profiler, model, shapes, world_size, micro)
        return cls(monitors, profiler, enabled)

    def forward(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Around the module's forward: the FLOPs profiler counts at its step."""
        return self.profiler.forward(step) if self.profiler is not None else contextlib.nullcontext()

    def after_backward(self, loss: torch.Tensor, boundary: bool, samples: int) -> None:
        """Add the micro-batch loss; on the boundary write the step's mean loss ([Note: monitor events])."""
        if not self.monitors:
            return
        mean = loss.detach().float().mean()
        self._loss_sum = mean if self._loss_sum is None else self._loss_sum + mean
        self._losses += 1
        if boundary:
            self.window_loss(samples)

    def window_loss(self, samples: int) -> None:
        """Write the mean of the losses added since the last write (the engine calls it at the step of a window the
        caller ended: [Note: caller-owned windows])."""
        if not self.monitors or not self._losses:
            return
        assert self._loss_sum is not None
        value = float(self._loss_sum.item()) / self._losses
        self._loss_sum, self._losses = None, 0
        self._write([("Train/Samples/train_loss", value, samples)])

    def batch_loss(self, name: str, loss: torch.Tensor, samples: int) -> None:
        """The pipeline engine's `Train/Samples/train_loss` or `eval_loss` ([Note: monitor events])."""
        if self.monitors:
            self._write([(name, float(loss.detach().float().mean().item()), samples)])

    def after_step(self, step: int, samples: int, lr: float, loss_scale: float | None) -> None:
        """After an optimizer step (`step` counted before it): lr and loss scale."""
        events: list[Event] = [("Train/Samples/lr", lr, samples)]
        if loss_scale is not None:
            events.append(("Train/Samples/loss_scale", loss_scale, samples))
        self._write(events)

    def profile_report(self, step: int, timings: dict[str, float]) -> None:
        """The FLOPs profile, at the end of `engine.step()` on the boundary of `step` (counted before it);
        `timings`: the wall-clock breakdown's milliseconds (empty without it)."""
        if self.profiler is not None:
            text = self.profiler.report(step, timings)
            if text is not None:
                report(text)  # [Note: reports the log level does not hide]

    def write_events(self, event_list: list[Event]) -> None:
        """DeepSpeed's `engine.monitor.write_events([(name, value, samples), ...])`: the script's own events,
        written on rank 0 (dropped elsewhere, as DeepSpeed does)."""
        self._write([(name, float(value), int(step)) for name, value, step in event_list])

    def close(self) -> None:
        for m in self.monitors:
            m.close()
        self.monitors = []
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = self.comet_monitor = None

    def _write(self, events: list[Event]) -> None:
        for m in self.monitors:
            m.write_events(events)
