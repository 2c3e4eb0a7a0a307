"""`zeroshard.moe.sharded_moe`: DeepSpeed's gating functions as its tests call them (their 4-tuple), equal to
DeepSpeed 0.19.8's to the bit from the same generator state; on 2 ranks, the capacity without dropping is the largest
over the expert-parallel group, and `_AllToAll` exchanges equal splits both ways."""

from __future__ import annotations

import pytest
import torch

from helpers.harness import run_on_ranks
from zeroshard.moe import sharded_moe


@pytest.mark.parametrize("drop_tokens", [True, False])
def test_gates_equal_deepspeeds(drop_tokens):
    reference = pytest.importorskip("deepspeed.moe.sharded_moe")
    torch.manual_seed(0)
    logits = torch.randn(96, 6)
    used = (torch.rand(96) > 0.3).long()
    calls = [
        ("top1gating", (1.0, 4), {"used_token": used, "noisy_gate_policy": "RSample"}),
        ("top2gating", (1.0, 4), {}),
        ("topkgating", (3, 1.0, 4), {"drop_policy": "probs"}),
        ("topkgating", (4, 0.5, 1), {"drop_policy": "position"}),
    ]
    for name, args, kwargs in calls:
        torch.manual_seed(1)
        want = getattr(reference, name)(logits.clone(), *args, drop_tokens=drop_tokens, **kwargs)
        torch.manual_seed(1)
        got = getattr(sharded_moe, name)(logits.clone(), *args, drop_tokens=drop_tokens, **kwargs)
        assert len(got) == 4, name
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w.cpu()), (name, kwargs)


def test_refused_in_one_line():
    with pytest.raises(ValueError, match="Tutel"):
        sharded_moe.top1gating(torch.randn(8, 2), 1.0, 1, use_tutel=True)
    with pytest.raises(ValueError, match="sparse dispatch"):
        sharded_moe.topkgating(torch.randn(8, 4), 3, 1.0, 1, sparse_routes=True)
    assert sharded_moe.TUTEL_INSTALLED is False


def _exchange(rank: int, world: int):
    import torch.distributed as dist

    import zeroshard

    zeroshard.init_distributed(dist_backend="gloo")
    logits = torch.zeros(8, 2)
    logits[:, 0] = 1.0  # every token's first choice is expert 0
    if rank == 1:
        logits[:4, 0] = -1.0  # rank 1 sends 4 of them to expert 1
    _, combine, dispatch, counts = sharded_moe.top1gating(logits, 1.0, 0, drop_tokens=False, ep_group=dist.group.WORLD)
    x = (torch.arange(4.0) + 10 * rank).requires_grad_()
    y = sharded_moe._AllToAll.apply(dist.group.WORLD, x)
    (y * torch.arange(1.0, 5.0)).sum().backward()
    return combine.shape, counts.tolist(), y.tolist(), x.grad.tolist()


def test_capacity_over_the_group_and_all_to_all():
    (shape0, counts0, y0, g0), (shape1, counts1, y1, g1) = run_on_ranks(_exchange, 2, timeout=120)
    assert counts0 == [8, 0] and counts1 == [4, 4]
    assert shape0 == shape1 == (8, 2, 8)  # rank 1's own capacity is 4: padded to the group's 8
    assert y0 == [0.0, 1.0, 10.0, 11.0] and y1 == [2.0, 3.0, 12.0, 13.0]
    assert g0 == [1.0, 2.0, 1.0, 2.0] and g1 == [3.0, 4.0, 3.0, 4.0]
