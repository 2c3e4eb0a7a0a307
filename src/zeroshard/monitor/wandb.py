"""`wandb`: scalar events to Weights & Biases (`WANDB_MODE=offline` keeps them in a local run folder)."""

from __future__ import annotations

from typing import Any

from zeroshard.config.monitor import WandbConfig
from zeroshard.errors import ConfigError
from zeroshard.monitor.base import Event, Monitor, writes_here

_OFFLINE = "or set WANDB_MODE=offline to keep the run in a local folder"


class WandbMonitor(Monitor):
    """`wandb.init(project, group, entity=team)` once, then `wandb.log({name: value}, step=samples)` per event,
    as DeepSpeed's WandbMonitor (`run` None where it is inert: base.py). What keeps `wandb.init` from starting a run
    is one line naming the block ([Note: monitors open first])."""

    def __init__(self, config: WandbConfig):
        super().__init__(config)
        self.group, self.team, self.project = config.group, config.team, config.project
        self.run: Any = None
        if not writes_here(config):
            return
        try:
            import wandb
        except ImportError as e:
            raise ConfigError("wandb.enabled needs the wandb package: pip install wandb") from e
        self._wandb: Any = wandb
        try:
            self.run = wandb.init(project=config.project, group=config.group, entity=config.team)
        except Exception as e:  # noqa: BLE001 - whatever wandb raises, it is this block that cannot start
            raise ConfigError(_failure(e, config)) from e

    def log(self, data: dict[str, Any], step: int | None = None, commit: bool | None = None) -> None:
        """DeepSpeed's `WandbMonitor.log`: `wandb.log(data, step, commit)` where this monitor writes."""
        if self.run is not None:
            self._wandb.log(data, step=step, commit=commit)

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.log({name: value}, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def _failure(error: Exception, config: WandbConfig) -> str:
    reason = " ".join(str(error).split()).rstrip(".") or type(error).__name__  # wandb's messages span lines
    if "no api key" in reason.lower():  # (an invalid key is reported as wandb words it)
        return f"wandb.enabled is true but wandb has no API key: run `wandb login`, set WANDB_API_KEY, {_OFFLINE}"
    run = f"project {config.project!r}, team {config.team!r}, group {config.group!r}"
    return f"wandb.enabled is true but wandb.init ({run}) failed: {reason}; check the wandb block and login, {_OFFLINE}"
