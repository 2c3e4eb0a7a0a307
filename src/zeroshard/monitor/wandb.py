"""`wandb`: scalar events to Weights & Biases (`WANDB_MODE=offline` keeps them in a local run folder)."""

from __future__ import annotations

from typing import Any

from zeroshard.config.monitor import WandbConfig
from zeroshard.errors import ConfigError
from zeroshard.monitor.base import Event


class WandbMonitor:
    """`wandb.init(project, group, entity=team)` once, then `wandb.log({name: value}, step=samples)` per event,
    as DeepSpeed's WandbMonitor."""

    def __init__(self, config: WandbConfig):
        try:
            import wandb
        except ImportError as e:
            raise ConfigError("wandb.enabled needs the wandb package: pip install wandb") from e
        self._wandb: Any = wandb
        self.run = wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self._wandb.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()
