"""`deepspeed.monitor.monitor`: the `Monitor` base class and `MonitorMaster`, the four monitor blocks behind one
`write_events`, for scripts that build DeepSpeed's monitors themselves (the engine's own is `engine.monitor`)."""

from __future__ import annotations

from typing import Any, TypeVar

from zeroshard.monitor.base import Event, Monitor, writes_here
from zeroshard.monitor.comet import CometMonitor
from zeroshard.monitor.csv_monitor import CSVMonitor, csvMonitor
from zeroshard.monitor.opening import build_monitors
from zeroshard.monitor.tensorboard import TensorBoardMonitor
from zeroshard.monitor.wandb import WandbMonitor

M = TypeVar("M", bound=Monitor)


class MonitorMaster(Monitor):
    """DeepSpeed's `MonitorMaster(monitor_config)`: one monitor per enabled block of a `DeepSpeedMonitorConfig`
    (`DeepSpeedConfig(...).monitor_config`), built on global rank 0 (None elsewhere and for disabled blocks), each
    event written to all of them.

    Example:
        >>> from zeroshard.monitor.config import DeepSpeedMonitorConfig
        >>> master = MonitorMaster(DeepSpeedMonitorConfig())
        >>> master.enabled, master.tb_monitor
        (False, None)
    """

    def __init__(self, monitor_config: Any):
        super().__init__(monitor_config)
        self.monitors = build_monitors(monitor_config) if writes_here(monitor_config) else []  # on rank 0
        self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor = by_kind(self.monitors)

    def write_events(self, events: list[Event]) -> None:
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = self.comet_monitor = None


def by_kind(
    monitors: list[Monitor],
) -> tuple[TensorBoardMonitor | None, WandbMonitor | None, CSVMonitor | None, CometMonitor | None]:
    """MonitorMaster's `tb_monitor`, `wandb_monitor`, `csv_monitor`, `comet_monitor` among `monitors`."""
    return (
        _the(TensorBoardMonitor, monitors),
        _the(WandbMonitor, monitors),
        _the(CSVMonitor, monitors),
        _the(CometMonitor, monitors),
    )


def _the(kind: type[M], monitors: list[Monitor]) -> M | None:
    return next((m for m in monitors if isinstance(m, kind)), None)


__all__ = ["CSVMonitor", "CometMonitor", "Monitor", "MonitorMaster", "TensorBoardMonitor", "WandbMonitor", "csvMonitor"]
