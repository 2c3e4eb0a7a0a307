"""DeepSpeed's runtime helpers that scripts call on their own tensors, on 2 ranks: `CheckOverflow` (an inf on one
rank's expert gradient is found on both, by the gradients and by a norm; a dense inf without an agreeing group
stays the rank's own), `PartitionedTensor` (even and uneven cuts, over the world and a one-rank group, rebuilt
from `to_meta`), `reduce_scatter_coalesced` (DeepSpeed's cases: averaged parts, uneven and empty ones, fp16 and
fp32, inputs left as they were)."""

from __future__ import annotations

from typing import Any

import torch

from helpers.harness import run_on_ranks


def _overflow(rank: int) -> dict[str, Any]:
    from torch._utils import _flatten_dense_tensors

    from zeroshard.runtime import utils
    from zeroshard.utils import groups

    groups._create_expert_and_data_parallel(2)
    dense, expert = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    dense.grad = torch.ones(1)
    expert.grad = torch.tensor([float("inf") if rank == 1 else 1.0])
    expert.allreduce = False  # type: ignore[attr-defined]  # the script's own mark ([Note: a script's expert parameters])
    params = [dense, expert]
    norm = utils.get_weight_norm([_flatten_dense_tensors([p.grad for p in params])])
    lone = torch.nn.Parameter(torch.zeros(2))
    lone.grad = torch.tensor([1.0, float("nan") if rank == 0 else 2.0])
    return {
        "by_grads": utils.CheckOverflow([params]).check(),
        "by_norm": utils.CheckOverflow([params]).check_using_norm([norm], reduce_overflow=False),
        "by_norm_world": utils.CheckOverflow().check_using_norm([1.0 if rank == 0 else float("nan")]),
        "dense_only": utils.CheckOverflow([[lone]]).check(),
        "given_later": utils.CheckOverflow().check([[dense]]),
        "global_norm": (utils.get_global_norm([3.0, 4.0]), utils.get_global_norm([1.0, -1])),
    }


def _partitioned(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from zeroshard.runtime.utils import PartitionedTensor

    torch.manual_seed(0)  # the same tensors on both ranks
    out: dict[str, Any] = {}
    for name, shape in {"even": (8, 3), "uneven": (7, 3), "tiny": (1,)}.items():
        full = torch.rand(shape)
        part = PartitionedTensor(full, group=dist.group.WORLD)
        again = PartitionedTensor.from_meta(part.to_meta(), part.local_data, dist.group.WORLD, device="cpu")
        out[name] = (part.local_size(), torch.equal(part.full(), full), torch.equal(again.full(), full))
    own = next(g for g in (dist.new_group([0]), dist.new_group([1])) if dist.get_rank(g) == 0)
    full = torch.rand(5) + rank
    part = PartitionedTensor(full, group=own)
    out["own_group"] = (part.local_size(), torch.equal(part.full(), full), part.partition)
    return out


def _coalesced(rank: int) -> dict[str, Any]:
    from zeroshard.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    out: dict[str, Any] = {}
    for dtype in (torch.float16, torch.float32):
        single = torch.full((6,), float(rank), dtype=dtype)
        (part,) = reduce_scatter_coalesced([single])
        two = [rank * torch.arange(0, 6, dtype=dtype), rank * torch.arange(6, 9, dtype=dtype)]
        first, second = reduce_scatter_coalesced(two)
        (small,) = reduce_scatter_coalesced([torch.zeros(1, dtype=dtype)])
        out[str(dtype)] = (part.tolist(), first.tolist(), second.tolist(), small.tolist(), single.tolist())
    return out


def _all(rank: int, world_size: int) -> dict[str, Any]:
    import zeroshard

    zeroshard.init_distributed(dist_backend="gloo")  # as a script without an engine starts
    return {"overflow": _overflow(rank), "partitioned": _partitioned(rank), "coalesced": _coalesced(rank)}


def test_runtime_helpers_on_two_ranks() -> None:
    for rank, out in enumerate(run_on_ranks(_all, 2, timeout=300)):
        overflow = out["overflow"]
        assert overflow["by_grads"] and overflow["by_norm"] and overflow["by_norm_world"], overflow
        assert overflow["dense_only"] is (rank == 0)  # no expert, no mpu, no engine: nothing to agree over
        assert overflow["given_later"] is False
        assert overflow["global_norm"] == (5.0, float("inf"))
        parts = out["partitioned"]
        assert parts["even"] == (torch.Size([12]), True, True)
        assert parts["uneven"] == (torch.Size([11 if rank == 0 else 10]), True, True)
        assert parts["tiny"] == (torch.Size([1 if rank == 0 else 0]), True, True)
        assert parts["own_group"] == (torch.Size([5]), True, [0, 5])
        for dtype in ("torch.float16", "torch.float32"):
            part, first, second, small, single = out["coalesced"][dtype]
            assert part == [0.5] * 3 and single == [float(rank)] * 6
            assert first == [x / 2 for x in range(3 * rank, 3 * rank + 3)]
            assert second == ([3.0, 3.5] if rank == 0 else [4.0])
            assert small == ([0.0] if rank == 0 else [])
