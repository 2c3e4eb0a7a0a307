"""`memory_report()`'s process columns: the OS's count of this process, not the strategy's own accounting."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from zeroshard import MemoryReport
from zeroshard.memory import process_memory

MiB = 1 << 20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read from /proc/self/status")
def test_process_memory_follows_an_allocation_the_strategy_does_not_know_of() -> None:
    # fresh pages from the kernel: a `torch.ones` may reuse heap pages an earlier test freed (glibc keeps them
    # resident where no allocator policy applies: [Note: glibc's mmap threshold]), and then RSS does not move
    region = mmap.mmap(-1, 64 * MiB)
    before = process_memory(torch.device("cpu"))
    block = torch.frombuffer(region, dtype=torch.uint8).fill_(1)  # touched: resident
    after = process_memory(torch.device("cpu"))
    assert after.process_rss - before.process_rss >= 60 * MiB
    assert after.process_peak_rss >= after.process_rss >= 60 * MiB
    assert after.device_allocated == after.device_peak_allocated == 0  # no CUDA columns on the CPU
    del block
    region.close()


def test_summary_shows_the_process_next_to_the_model_states() -> None:
    report = MemoryReport(stage=3, params=2 * MiB, gradients=2 * MiB, process_rss=500 * MiB, process_peak_rss=700 * MiB)
    line = report.summary()
    assert "model states 4.0 MiB/rank (stage 3)" in line and "process RSS 500 MiB, peak 700 MiB" in line
    assert "CUDA" not in line
    report.device_allocated, report.device_peak_allocated = 10 * MiB, 30 * MiB
    assert report.summary().endswith("CUDA allocated 10 MiB, peak 30 MiB")
