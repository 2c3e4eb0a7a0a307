"""Output a user asked for, which the log level does not hide.

[Note: reports the log level does not hide] Some output exists only because the user asked for it by name: the
`comms_logger` table from `deepspeed.comm.log_summary()` (or `engine.comms_logger.log_all()`), the
`wall_clock_breakdown` "time (ms)" lines, the FLOPs profile. DeepSpeed prints these with `print`, so its
`log_level: "warning"` (which quiets its logger) leaves them on screen. We keep them in the logging system (STYLE: no
prints; the lines keep the rank tag and go where zeroshard's handlers send them, which a script may have redirected)
but hand the record to those handlers directly, past the level that ds_config `log_level` set on the logger and its
handlers: a record at INFO that is written whatever the level. A script silences them as it would any handler's
output, with a filter on zeroshard's handler that drops records named `zeroshard.report`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch.distributed as dist

from zeroshard.utils.logging import get_logger

_NAME = "zeroshard.report"


def report(message: str, ranks: Iterable[int] | None = (0,)) -> None:
    """Write `message` at INFO through zeroshard's log handlers, whatever the log level, on the given ranks (every
    rank when `ranks` is None) ([Note: reports the log level does not hide]).

    Example:
        >>> from zeroshard.reporting import report
        >>> report("time (ms) | fwd: 1.00")  # doctest: +SKIP
    """
    if ranks is not None and _rank() not in set(ranks):
        return
    package = get_logger()  # "zeroshard": its handlers, configured once there
    record = logging.getLogger(_NAME).makeRecord(_NAME, logging.INFO, __file__, 0, message, (), None)
    for handler in package.handlers:
        handler.handle(record)


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
