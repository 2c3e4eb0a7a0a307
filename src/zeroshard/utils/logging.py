"""A rank-aware logger: messages carry the rank, and `ranks=[0]` limits who prints."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Hashable, Iterable
from typing import Any

_FORMAT = "[zeroshard %(rank)s] %(levelname)s %(message)s"


class _RankFilter(logging.Filter):
    """Tags records with the rank; config messages (identical on every rank) are kept on rank 0 only."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _current_rank()
        record.rank = rank  # type: ignore[attr-defined]
        return not (record.name.startswith("zeroshard.config") and rank != 0)


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def get_logger(name: str = "zeroshard") -> logging.Logger:
    """Return the package logger (configured once, level from ZEROSHARD_LOG_LEVEL, default INFO)."""
    logger = logging.getLogger(name)
    root = logging.getLogger("zeroshard")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(_RankFilter())
        root.addHandler(handler)
        root.setLevel(os.environ.get("ZEROSHARD_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logger


def log_rank(logger: logging.Logger, level: int, msg: str, ranks: Iterable[int] | None = (0,)) -> None:
    """Log `msg` on the given ranks only (all ranks when `ranks` is None)."""
    if ranks is None or _current_rank() in set(ranks):
        logger.log(level, msg)


# DeepSpeed scripts import `logger` from `deepspeed.utils` / `deepspeed.utils.logging` and log through it.
logger = get_logger("zeroshard")


def _selected_rank(ranks: Iterable[int] | None) -> int | None:
    """DeepSpeed's rank rule for its `*_dist` helpers: this process's rank (-1 before torch.distributed is
    initialised) when it should write, else None. Listed ranks write (`[-1]`: all); None or []: none once
    torch.distributed is initialised, every process before."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else -1
    wanted = list(ranks or [])
    if not initialized or (wanted and (wanted[0] == -1 or rank in wanted)):
        return rank
    return None


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """DeepSpeed's `log_dist`: log on the listed ranks (`[-1]`: all ranks; None or []: none once
    torch.distributed is initialised, all before), prefixed with the rank as DeepSpeed does.

    Example:
        >>> from zeroshard.utils import log_dist
        >>> log_dist("step 10", ranks=[0])
    """
    rank = _selected_rank(ranks)
    if rank is not None:
        logger.log(level, "[Rank %d] %s", rank, message)


class _Emitted:
    """The messages `warning_once` and `log_dist_once` have emitted. Once per process is what they mean (the
    logger they write to is process-wide too), so one instance below holds them, as DeepSpeed's lru_cache does."""

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()

    def first(self, key: Hashable) -> bool:
        """Whether `key` is new (and remember it)."""
        try:
            if key in self._seen:
                return False
        except TypeError:  # unhashable arguments: DeepSpeed's cache raises; remember them by their text
            key = repr(key)
            if key in self._seen:
                return False
        self._seen.add(key)
        return True


_EMITTED = _Emitted()


def warning_once(*args: Any, **kwargs: Any) -> None:
    """DeepSpeed's `logger.warning_once`: `logger.warning(*args, **kwargs)`, only the first time these arguments
    are given in this process (also `zeroshard.utils.logger.warning_once`).

    Example:
        >>> logger.warning_once("fp16 is slow on this device")
    """
    if _EMITTED.first(("warning", args, tuple(sorted(kwargs.items())))):
        logger.warning(*args, **kwargs)


def log_dist_once(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """DeepSpeed's: `log_dist(message, ranks, level)` only the first time these arguments are given in this
    process (also `logger.log_dist_once`)."""
    if _EMITTED.first(("log_dist", message, None if ranks is None else tuple(ranks), level)):
        log_dist(message, ranks=ranks, level=level)


# DeepSpeed's logger carries these two as methods; the names are set on zeroshard's own logger, nothing else's
setattr(logger, "warning_once", warning_once)  # noqa: B010 - a Logger has no such attribute to type
setattr(logger, "log_dist_once", log_dist_once)  # noqa: B010


def print_json_dist(message: dict[str, Any], ranks: Iterable[int] | None = None, path: str | None = None) -> None:
    """DeepSpeed's: on the ranks `log_dist` would log on, add `"rank"` to `message` (a dict) and write it as
    JSON to `path`, synced to disk (every selected rank writes the same `path`: give each its own).

    Example:
        >>> print_json_dist({"step": 10, "loss": 1.5}, ranks=[0], path="/tmp/metrics.json")
    """
    if path is None:
        raise TypeError("print_json_dist needs path=, the file to write the JSON to")
    rank = _selected_rank(ranks)
    if rank is None:
        return
    message["rank"] = rank
    with open(path, "w") as out:
        json.dump(message, out)
        out.flush()
        os.fsync(out.fileno())


def print_configuration(obj: object, name: str) -> None:
    """DeepSpeed's `print_configuration` (what `dump_state` prints at initialize): `name:`, then one line per
    public attribute of `obj`, sorted, with its value; on rank 0."""
    logger = get_logger()
    log_rank(logger, logging.INFO, f"{name}:")
    for attribute in sorted(key for key in vars(obj) if not key.startswith("_")):
        dots = "." * (29 - len(attribute))
        log_rank(logger, logging.INFO, f"  {attribute} {dots} {getattr(obj, attribute)}")


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """DeepSpeed's: set `custom_logger` (zeroshard's logger by default) and its handlers to the level named by
    `log_level_str` ("debug", "info", "warning", "error", "critical"); ds_config `log_level` does this at
    initialize."""
    level = logging.getLevelName(log_level_str.upper())
    if not isinstance(level, int):
        raise ValueError(f"{log_level_str!r} is not a log level (debug, info, warning, error, critical)")
    target = custom_logger or get_logger()
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)
