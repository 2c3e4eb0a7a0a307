"""One interface for every monitor backend: DeepSpeed's `write_events([(name, value, step), ...])`."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

from zeroshard.errors import ConfigError
from zeroshard.utils.files import probe_writable

Event = tuple[str, float, int]  # (name such as "Train/Samples/lr", value, x-axis: global samples)


class Monitor(ABC):
    """A backend that records scalar events: DeepSpeed's `deepspeed.monitor.monitor.Monitor`, built from its config
    block. Built for a disabled block, or in a process other than global rank 0, it is inert and writes nothing, as
    DeepSpeed's monitors (a script's own `TensorBoardMonitor(ds_config.monitor_config.tensorboard)` on every rank);
    `initialize` builds the enabled ones on rank 0 only (opening.py)."""

    def __init__(self, monitor_config: Any):
        self.monitor_config = monitor_config
        self.enabled = bool(getattr(monitor_config, "enabled", False))  # DeepSpeed's base stores the config alone

    @abstractmethod
    def write_events(self, events: list[Event]) -> None:
        """Record `(name, value, global samples)` events (nothing when inert)."""

    def close(self) -> None:  # noqa: B027 - a backend with nothing to end keeps this one
        """End the backend's run (the engine's `destroy`, a failed `initialize`)."""


def writes_here(config: Any) -> bool:
    """Whether a monitor built from `config` writes in this process: enabled, on global rank 0 (DeepSpeed's one
    writer; rank 0 also before `torch.distributed` starts)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return bool(config.enabled) and rank == 0


def log_dir(output_path: str, job_name: str, block: str) -> str:
    """`<output_path>/<job_name>`, created, as DeepSpeed's monitors lay it out (empty output_path: the cwd).

    It is also written to once (a file made and removed), so that a directory the logs cannot go to is one line
    naming `<block>.output_path` now, not an OSError at the first event ([Note: monitors open first])."""
    path = os.path.join(output_path, job_name)
    try:
        probe_writable(path)
    except OSError as e:
        where = f"'{output_path}'" if output_path else "empty (the current directory)"
        raise ConfigError(
            f"{block}.output_path is {where}, and the logs cannot be written to {os.path.abspath(path)} "
            f"({e.strerror or e}); set {block}.output_path to a directory this process can write to"
        ) from e
    return path


def writable_file(path: str, key: str) -> None:
    """The folder of the file `key` names is made and written to once (rank 0 writes it at a later step): a path
    that cannot take it is one line naming `key` now ([Note: monitors open first])."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        probe_writable(folder)
    except OSError as e:
        raise ConfigError(
            f"{key} is '{path}', and {folder} cannot be written to ({e.strerror or e}); set {key} to a file in a "
            "directory this process can write to"
        ) from e
