"""The collectives module: results, byte counters, and the fail-fast check of mismatched collectives."""

from __future__ import annotations

import pytest
import torch

from helpers.harness import run_on_ranks


def _collectives(rank: int, world_size: int):
    from zeroshard.comm import Collectives, init_distributed
    from zeroshard.errors import CollectiveMismatchError

    init_distributed()
    comm = Collectives(None, world_size, rank, verify=True)
    x = torch.full((4,), float(rank + 1))
    comm.all_reduce(x)
    out = torch.empty(2)
    comm.reduce_scatter(out, torch.arange(4.0) * (rank + 1))
    gathered = torch.empty(4)
    comm.all_gather(gathered, torch.full((2,), float(rank)))
    stats = comm.stats.snapshot()
    mismatch = None
    try:  # rank 1 issues a different-sized collective: must raise on every rank, not hang
        comm.all_reduce(torch.ones(8 if rank == 0 else 16))
    except CollectiveMismatchError as err:
        mismatch = str(err)
    return x.tolist(), out.tolist(), gathered.tolist(), stats, mismatch


def test_collectives_results_counters_and_mismatch():
    results = run_on_ranks(_collectives, 2, timeout=120)
    for rank, (reduced, scattered, gathered, stats, mismatch) in enumerate(results):
        assert reduced == [3.0] * 4
        assert scattered == ([0.0, 3.0] if rank == 0 else [6.0, 9.0])
        assert gathered == [0.0, 0.0, 1.0, 1.0]
        assert stats["all_reduce"]["bus_bytes"] == 2 * 16 * 0.5
        assert stats["reduce_scatter"]["bus_bytes"] == 16 * 0.5
        assert stats["all_gather"]["bus_bytes"] == 16 * 0.5
        assert mismatch and "numel=8" in mismatch and "numel=16" in mismatch and "rank 1" in mismatch


def test_single_rank_is_a_no_op():
    from zeroshard.comm import Collectives

    comm = Collectives(None, 1, 0)
    out = torch.empty(3)
    comm.all_gather(out, torch.tensor([1.0, 2.0, 3.0]))
    assert out.tolist() == [1.0, 2.0, 3.0] and comm.stats.total_bus_bytes == 0
    with pytest.raises(ValueError, match="expected 1 x 2"):
        comm.reduce_scatter(torch.empty(2), torch.empty(3))
