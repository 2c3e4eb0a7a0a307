"""Checkpoints of a `zeroshard train` run through the engine's DeepSpeed-style API.

`engine.save_checkpoint(dir, client_state=...)` / `engine.load_checkpoint(dir)` are called on every
rank. The training loop's own position (epoch and batches consumed in it) travels in client_state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from zeroshard.errors import ConfigError
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

CLIENT_KEY = "zeroshard_train"


@dataclass
class LoopPosition:
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of `epoch` already consumed

    def to_state(self) -> dict[str, Any]:
        return {CLIENT_KEY: {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> LoopPosition:
        mine = (state or {}).get(CLIENT_KEY) or {}
        return cls(int(mine.get("epoch", 0)), int(mine.get("batches_in_epoch", 0)))


class Checkpointer:
    def __init__(self, engine: Any, folder: str):
        self.engine = engine
        self.folder = folder

    def save(self, position: LoopPosition) -> None:
        self.engine.save_checkpoint(self.folder, client_state=position.to_state())

    def has_latest(self, folder: str | None = None) -> bool:
        return os.path.isfile(os.path.join(folder or self.folder, "latest"))

    def resume(self, request: str | None, restarted: bool) -> LoopPosition | None:
        """Load the checkpoint `request` asks for ("auto": the run's latest, a path: that folder).

        After an elastic restart the latest checkpoint is loaded even without --resume. Returns None
        when there is nothing to load and that is fine (first start, or "auto" with no checkpoint yet).
        """
        if request is None and not restarted:
            return None
        folder = self.folder if request in (None, "auto") else str(request)
        if not self.has_latest(folder):
            if request not in (None, "auto"):
                raise ConfigError(f"--resume {request}: no checkpoint there (no 'latest' file)")
            log_rank(logger, 20, f"no checkpoint in {folder} yet: starting from step 0")
            return None
        path, client_state = self.engine.load_checkpoint(folder)
        log_rank(logger, 20, f"resumed from {path} at step {self.engine.global_steps}")
        return LoopPosition.from_state(client_state)
