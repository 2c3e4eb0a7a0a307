"""One interface for every monitor backend: DeepSpeed's `write_events([(name, value, step), ...])`."""

from __future__ import annotations

import os
from typing import Protocol

Event = tuple[str, float, int]  # (name such as "Train/Samples/lr", value, x-axis: global samples)


class Monitor(Protocol):
    """A backend that records scalar events; built on rank 0 only (telemetry.py)."""

    def write_events(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


def log_dir(output_path: str, job_name: str) -> str:
    """`<output_path>/<job_name>`, created, as DeepSpeed's monitors lay it out (empty output_path: the cwd)."""
    path = os.path.join(output_path, job_name)
    os.makedirs(path, exist_ok=True)
    return path
