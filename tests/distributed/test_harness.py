"""The test harness itself: a rank that dies without reporting is named at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from helpers.harness import run_on_ranks


def _killed(rank: int, world_size: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as a CUDA/NCCL abort, a segfault or the OOM killer end a rank
    time.sleep(60)
    return rank


def test_a_rank_killed_by_a_signal_is_named_without_waiting_for_the_timeout():
    """It waited the whole timeout (600 s by default) before: on the GPU call's bounded step, that was every later
    test lost."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"died without reporting \(exit codes \{1: -9\}\)"):
        run_on_ranks(_killed, 2, timeout=120)
    assert time.monotonic() - start < 30
