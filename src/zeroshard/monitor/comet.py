"""`comet`: scalar events to Comet (`"online": false` stores an offline experiment archive to upload later).

As DeepSpeed 0.19.8's CometMonitor: `comet_ml.start(api_key, project, workspace, experiment_key, mode, online)`
once on rank 0 (the experiment named `experiment_name` when given), then each event logged as a metric at its
global samples, an event name at most once every `samples_log_interval` samples (its first one always).
"""

from __future__ import annotations

from typing import Any

from zeroshard.config.monitor import CometConfig
from zeroshard.errors import ConfigError
from zeroshard.monitor.base import Event, Monitor, writes_here


class CometMonitor(Monitor):
    """Comet metrics, thinned to one per `samples_log_interval` samples per name (`experiment` None where it is
    inert: base.py). What keeps `comet_ml.start` from starting the experiment is one line naming the block ([Note:
    monitors open first])."""

    def __init__(self, config: CometConfig):
        super().__init__(config)
        self.samples_log_interval = int(config.samples_log_interval)
        self.experiment: Any = None
        self._last_logged: dict[str, int] = {}  # name -> global samples of its last logged value
        if not writes_here(config):
            return
        try:
            import comet_ml
        except ImportError as e:
            raise ConfigError("comet.enabled needs the comet_ml package: pip install comet_ml") from e
        if _lacks_api_key(comet_ml, config):  # before comet_ml.start, which can retry the network before it says so
            raise ConfigError(
                "comet.enabled is true but Comet has no API key: set comet.api_key, set COMET_API_KEY or run "
                "`comet login`, or set comet.online to false to store an offline experiment"
            )
        try:
            self.experiment = comet_ml.start(
                api_key=config.api_key,
                project=config.project,
                workspace=config.workspace,
                experiment_key=config.experiment_key,
                mode=config.mode,
                online=config.online,
            )
            if config.experiment_name is not None:
                self.experiment.set_name(config.experiment_name)
        except Exception as e:  # noqa: BLE001 - whatever comet_ml raises, it is this block that cannot start
            reason = " ".join(str(e).split()).rstrip(".") or type(e).__name__  # one line
            offline = ", or set comet.online to false" if config.online is not False else ""
            raise ConfigError(
                f"comet.enabled is true but comet_ml.start failed: {reason}; check the comet block (api_key, "
                f"project, workspace, experiment_key, mode){offline}"
            ) from e

    def write_events(self, events: list[Event]) -> None:
        if self.experiment is None:
            return
        for name, value, samples in events:
            last = self._last_logged.get(name)
            if last is None or samples - last >= self.samples_log_interval:
                self._last_logged[name] = samples
                self.experiment.log_metric(name, value, step=samples)

    def close(self) -> None:
        if self.experiment is not None:
            self.experiment.end()
            self.experiment = None


def _lacks_api_key(comet_ml: Any, config: CometConfig) -> bool:
    """Online (the block's `online`, else comet_ml's setting, COMET_START_ONLINE; on by default) with no API key
    from the block, COMET_API_KEY or Comet's config file, read as comet_ml.start reads them. A comet_ml without
    these functions leaves it to comet_ml.start."""
    try:
        settings = comet_ml.config.get_config()
        online = settings.get_bool(config.online, "comet.start.online", default=True, not_set_value=None)
        return bool(online) and comet_ml.config.get_api_key(config.api_key, settings) is None
    except (AttributeError, TypeError):
        return False
