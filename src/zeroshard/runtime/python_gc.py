"""`disable_python_gc`: no automatic cyclic garbage collection while an engine that asked for it is alive.

[Note: python gc per process]
Python's cyclic collector can pause a training step at any allocation for as long as it takes to walk every
tracked object (seconds in a large process); DeepSpeed 0.19's `"disable_python_gc": true` switches it off for the
engine's lifetime and offers `engine.collect_python_gc()` to collect at a point the script chooses. The collector
is the process's, so its state is counted per process, not per engine (the one module-level object here, as the
`OWNERS` registry is for parameters): the first such engine collects once and disables it, the last one to be
destroyed (or dropped: a finalizer releases it) re-enables it if it was enabled before; a forked child starts
with none counted and the collector as its parent had it before the first engine.
"""

from __future__ import annotations

import gc
import os
import threading

from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


class PythonGC:
    """The count of engines that disabled the collector ([Note: python gc per process])."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._engines = 0
        self._was_enabled = False
        self._generation = 0
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork_child)

    def acquire(self) -> int:
        """An engine wants the collector off; returns the token `release` takes."""
        with self._lock:
            if self._engines == 0:
                self._was_enabled = gc.isenabled()
                if self._was_enabled:
                    collected = gc.collect()
                    gc.disable()
                    log_rank(logger, 20, f"automatic Python cyclic GC disabled after collecting {collected} objects")
            self._engines += 1
            return self._generation

    def release(self, token: int) -> None:
        with self._lock:
            if token != self._generation or self._engines == 0:
                return
            self._engines -= 1
            if self._engines == 0 and self._was_enabled:
                self._was_enabled = False
                gc.enable()
                log_rank(logger, 20, "automatic Python cyclic GC restored")

    @property
    def engines(self) -> int:
        return self._engines

    def _after_fork_child(self) -> None:
        if self._engines > 0 and self._was_enabled:
            gc.enable()
        self._engines, self._was_enabled = 0, False
        self._generation += 1
        self._lock = threading.RLock()


PYTHON_GC = PythonGC()
