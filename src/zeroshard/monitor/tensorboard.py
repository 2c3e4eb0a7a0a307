"""`tensorboard`: scalar events through torch.utils.tensorboard's SummaryWriter."""

from __future__ import annotations

from zeroshard.config.monitor import TensorBoardConfig
from zeroshard.errors import ConfigError
from zeroshard.monitor.base import Event, log_dir


class TensorBoardMonitor:
    """Writes each event with `add_scalar(name, value, samples)` under `<output_path>/<job_name>`, flushed after
    every batch of events, as DeepSpeed's TensorBoardMonitor."""

    def __init__(self, config: TensorBoardConfig):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError("tensorboard.enabled needs the tensorboard package: pip install tensorboard") from e
        self.writer = SummaryWriter(log_dir=log_dir(config.output_path, config.job_name, "tensorboard"))

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
