"""The checkpoint error type."""

from __future__ import annotations

from zeroshard.errors import ZeroshardError


class CheckpointError(ZeroshardError):
    """A checkpoint cannot be written or read: a missing rank, a truncated or corrupted file, a mismatch.

    The message names the file (or the ranks) concerned and what to do.
    """
