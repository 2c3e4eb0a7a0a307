"""`comet`: scalar events to Comet (`"online": false` stores an offline experiment archive to upload later).

As DeepSpeed 0.19.8's CometMonitor: `comet_ml.start(api_key, project, workspace, experiment_key, mode, online)`
once on rank 0 (the experiment named `experiment_name` when given), then each event logged as a metric at its
global samples, an event name at most once every `samples_log_interval` samples (its first one always).
"""

from __future__ import annotations

from typing import Any

from zeroshard.config.monitor import CometConfig
from zeroshard.errors import ConfigError
from zeroshard.monitor.base import Event


class CometMonitor:
    """Comet metrics, thinned to one per `samples_log_interval` samples per name."""

    def __init__(self, config: CometConfig):
        try:
            import comet_ml
        except ImportError as e:
            raise ConfigError("comet.enabled needs the comet_ml package: pip install comet_ml") from e
        self.samples_log_interval = int(config.samples_log_interval)
        self.experiment: Any = comet_ml.start(
            api_key=config.api_key,
            project=config.project,
            workspace=config.workspace,
            experiment_key=config.experiment_key,
            mode=config.mode,
            online=config.online,
        )
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self._last_logged: dict[str, int] = {}  # name -> global samples of its last logged value

    def write_events(self, events: list[Event]) -> None:
        for name, value, samples in events:
            last = self._last_logged.get(name)
            if last is None or samples - last >= self.samples_log_interval:
                self._last_logged[name] = samples
                self.experiment.log_metric(name, value, step=samples)

    def close(self) -> None:
        self.experiment.end()
