"""`deepspeed.monitor.config.DeepSpeedMonitorConfig`: the four monitor blocks of a ds_config together, as
`DeepSpeedConfig(...).monitor_config` gives them ([Note: DeepSpeedConfig] in runtime/ds_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroshard.config.monitor import CometConfig, CSVMonitorConfig, TensorBoardConfig, WandbConfig


@dataclass(frozen=True)
class DeepSpeedMonitorConfig:
    """The `tensorboard`, `wandb`, `csv_monitor` and `comet` blocks (DeepSpeed's defaults when not given).

    Example:
        >>> DeepSpeedMonitorConfig().tensorboard.job_name
        'DeepSpeedJobName'
    """

    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv_monitor: CSVMonitorConfig = field(default_factory=CSVMonitorConfig)
    comet: CometConfig = field(default_factory=CometConfig)

    @property
    def enabled(self) -> bool:
        """Whether any of the four monitors is on."""
        return any(block.enabled for block in (self.tensorboard, self.wandb, self.csv_monitor, self.comet))


__all__ = ["DeepSpeedMonitorConfig"]
