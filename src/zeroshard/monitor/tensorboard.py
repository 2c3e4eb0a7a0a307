"""`tensorboard`: scalar events through torch.utils.tensorboard's SummaryWriter."""

from __future__ import annotations

from typing import Any

from zeroshard.config.monitor import TensorBoardConfig
from zeroshard.errors import ConfigError
from zeroshard.monitor.base import Event, Monitor, log_dir, writes_here


class TensorBoardMonitor(Monitor):
    """Writes each event with `add_scalar(name, value, samples)` under `<output_path>/<job_name>`, flushed after
    every batch of events, as DeepSpeed's TensorBoardMonitor (`summary_writer` None where it is inert: base.py).

    Example:
        >>> TensorBoardMonitor(TensorBoardConfig()).summary_writer is None  # a disabled block writes nothing
        True
    """

    def __init__(self, config: TensorBoardConfig):
        super().__init__(config)
        self.output_path, self.job_name = config.output_path, config.job_name
        self.summary_writer: Any = None
        if writes_here(config):
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError("tensorboard.enabled needs the tensorboard package: pip install tensorboard") from e
            self.summary_writer = SummaryWriter(log_dir=log_dir(config.output_path, config.job_name, "tensorboard"))

    def write_events(self, events: list[Event], flush: bool = True) -> None:
        if self.summary_writer is None:
            return
        for name, value, step in events:
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            self.summary_writer.flush()

    def get_summary_writer(self) -> Any:
        """DeepSpeed's accessor: the SummaryWriter, None where this monitor is inert or closed."""
        return self.summary_writer

    def flush(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.flush()

    def close(self) -> None:
        if self.summary_writer is not None:
            self.summary_writer.close()
            self.summary_writer = None  # written to after this, a SummaryWriter would open a new event file
