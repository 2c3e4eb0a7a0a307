"""`StepPolicy`'s pre- and post-scaling of gradients against DeepSpeed 0.19.8's reduction code (no process group).

DeepSpeed's engine (`allreduce_bucket`, stage 0) and ZeRO-1/2 optimizer (`allreduce_bucket`) do, per rank:
with `prescale_gradients`, `g *= 1 / world_size` then all-reduce; otherwise `g *= 1 / gradient_predivide_factor`
(when it is not 1), all-reduce, then `g *= gradient_predivide_factor / world_size` (when they differ). The test
runs that arithmetic and ours on the same fp32 gradients of 4 simulated ranks and wants bit-identical means.
"""

from __future__ import annotations

import pytest
import torch

from zeroshard.zero.stepmath import StepPolicy


def _deepspeed_mean(grads: list[torch.Tensor], prescale: bool, factor: float) -> torch.Tensor:
    world = len(grads)
    sent = [g.clone() for g in grads]
    if prescale:
        for g in sent:
            g.mul_(1.0 / world)
    elif factor != 1.0:
        for g in sent:
            g.mul_(1.0 / factor)
    total = torch.stack(sent).sum(0)
    if not prescale and factor != world:
        total.mul_(factor / world)
    return total


def _our_mean(grads: list[torch.Tensor], policy: StepPolicy) -> torch.Tensor:
    world = len(grads)
    pre = policy.prescale(world)
    sent = [g * pre if pre != 1.0 else g.clone() for g in grads]
    total = torch.stack(sent).sum(0)
    post = policy.post_scale(world)
    return total * post if post != 1.0 else total


@pytest.mark.parametrize("prescale", [False, True])
@pytest.mark.parametrize("factor", [1.0, 2.0, 3.0, 4.0])
def test_pre_and_post_scaling_follow_deepspeed(prescale: bool, factor: float) -> None:
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=gen) * 1e3 for _ in range(4)]
    policy = StepPolicy(
        gradient_clipping=0.0, prescale_gradients=prescale, gradient_predivide_factor=factor, check_overflow=False
    )
    assert torch.equal(_our_mean(grads, policy), _deepspeed_mean(grads, prescale, factor))
