"""`wandb`: scalar events to Weights & Biases (`WANDB_MODE=offline` keeps them in a local run folder)."""

from __future__ import annotations

from typing import Any

from zeroshard.config.monitor import WandbConfig
from zeroshard.errors import ConfigError
from zeroshard.monitor.base import Event

_OFFLINE = "or set WANDB_MODE=offline to keep the run in a local folder"


class WandbMonitor:
    """`wandb.init(project, group, entity=team)` once, then `wandb.log({name: value}, step=samples)` per event,
    as DeepSpeed's WandbMonitor. What keeps `wandb.init` from starting a run is one line naming the block
    ([Note: monitors open first])."""

    def __init__(self, config: WandbConfig):
        try:
            import wandb
        except ImportError as e:
            raise ConfigError("wandb.enabled needs the wandb package: pip install wandb") from e
        self._wandb: Any = wandb
        try:
            self.run = wandb.init(project=config.project, group=config.group, entity=config.team)
        except Exception as e:  # noqa: BLE001 - whatever wandb raises, it is this block that cannot start
            raise ConfigError(_failure(e, config)) from e

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self._wandb.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()


def _failure(error: Exception, config: WandbConfig) -> str:
    reason = " ".join(str(error).split()).rstrip(".") or type(error).__name__  # wandb's messages span lines
    if "no api key" in reason.lower():  # (an invalid key is reported as wandb words it)
        return f"wandb.enabled is true but wandb has no API key: run `wandb login`, set WANDB_API_KEY, {_OFFLINE}"
    run = f"project {config.project!r}, team {config.team!r}, group {config.group!r}"
    return f"wandb.enabled is true but wandb.init ({run}) failed: {reason}; check the wandb block and login, {_OFFLINE}"
