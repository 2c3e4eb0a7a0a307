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


def _peak_rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def _in_place_on_gloo(rank: int, world_size: int):
    """[Note: gloo in place]: the chunked paths give the fused collectives' results, in the caller's buffers."""
    from zeroshard.comm import Collectives, init_distributed
    from zeroshard.offload.host_memory import apply_host_policy

    init_distributed()
    # freed temporaries go back to the OS: VmHWM shows each call's own
    apply_host_policy(torch.device("cpu"), churns=True)
    comm = Collectives(None, world_size, rank)
    numel = world_size * (1 << 20)  # 4 MiB of fp32 per chunk
    values = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    scratch, whole, in_place, fused_input = values.clone(), torch.zeros(numel), torch.zeros(numel), values.clone()
    fused_out, fused_whole = torch.zeros(numel // world_size), torch.zeros(numel)
    chunked = in_place.view(world_size, -1)[rank]
    comm.all_reduce(torch.ones(1))  # connections up before measuring
    before = _peak_rss()
    comm.reduce_scatter(chunked, scratch, async_op=True, input_is_scratch=True).wait()
    comm.all_gather(whole, chunked.clone())  # input not a view of the output: copied into this rank's chunk
    comm.all_gather(in_place, chunked, async_op=True).wait()  # input is this rank's chunk of the output
    chunked_growth = _peak_rss() - before
    before = _peak_rss()
    torch.distributed.reduce_scatter_tensor(fused_out, fused_input)
    torch.distributed.all_gather_into_tensor(fused_whole, fused_out)
    fused_growth = _peak_rss() - before
    return fused_out, fused_whole, whole, in_place, chunked_growth, fused_growth, comm.stats.snapshot()


def test_gloo_chunked_collectives_match_the_fused_ones_in_place():
    world_size = 3  # not a power of two: gloo's reduce and broadcast trees are uneven
    results = run_on_ranks(_in_place_on_gloo, world_size, timeout=120)
    for rank, (fused_out, fused_whole, whole, in_place, chunked_growth, fused_growth, stats) in enumerate(results):
        mine = in_place.view(world_size, -1)[rank]
        torch.testing.assert_close(mine, fused_out, rtol=1e-6, atol=1e-6)  # gloo's reduce adds in another order
        torch.testing.assert_close(whole, fused_whole, rtol=1e-6, atol=1e-6)
        assert torch.equal(whole, in_place)
        # the fused calls copy the 12 MiB message into temporaries of its size; the chunked ones work in place
        assert fused_growth > 8 * (1 << 20) and chunked_growth < 6 * (1 << 20), (fused_growth, chunked_growth)
        assert stats["reduce_scatter"]["calls"] == 1 and stats["all_gather"]["calls"] == 2


def _diagnosed_in_two_groups(rank: int, world_size: int):
    """Two data-parallel groups, {0, 1} and {2, 3}: ranks 0 and 2 wait on an all-reduce their peer issues late."""
    import time

    import torch.distributed as dist

    from zeroshard.comm import Collectives, init_distributed
    from zeroshard.comm.divergence import DivergenceWatch
    from zeroshard.errors import CollectiveMismatchError

    init_distributed()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    comm = Collectives(groups[rank // 2], 2, rank % 2)
    watch = DivergenceWatch(comm, torch.device("cpu"), 1.0, str)
    message = ""
    if rank % 2 == 0:
        handle = comm.all_reduce(torch.ones(4), async_op=True)
        try:
            watch.wait(handle, f"the all-reduce of rank {rank}")
        except CollectiveMismatchError as err:
            message = str(err)
    else:
        time.sleep(2.0)  # past the waiter's 1 s deadline: it asks, and this rank, busy, never answers
        comm.all_reduce(torch.ones(4))
    dist.barrier()
    return message


# slow (CI budget): the world-group diagnosis stays in the default suite; this is its two-group variant
@pytest.mark.slow
def test_a_diverged_wait_asks_the_ranks_of_its_own_group():
    """Each rank posts under its global rank: under group ranks rank 2's post (group rank 0) overwrote rank 0's, and
    each waiter read the other group's."""
    messages = run_on_ranks(_diagnosed_in_two_groups, 4, timeout=180)
    for waiter, peer, others in ((0, 1, (2, 3)), (2, 3, (0, 1))):
        text = messages[waiter]
        assert text.startswith(f"ranks diverged: rank {waiter} waited 1s on the all-reduce of rank {waiter}"), text
        assert f"rank {waiter}: waiting on the all-reduce of rank {waiter}" in text, text
        assert f"rank {peer}: did not answer" in text and not any(f"rank {r}:" in text for r in others), text
    assert messages[1] == messages[3] == ""
