"""zeroshard's MoE layer against DeepSpeed 0.19.8's, the same weights and tokens: output, l_aux, exp_counts and
gradients, on 1 rank (all experts local) and on 2 ranks with ep_size 2 (the exchange puts each token on the same
expert as DeepSpeed's all-to-all)."""

from __future__ import annotations

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks

CASES = [  # deterministic routing: no random token selection, no sampled second expert
    {"k": 1, "capacity_factor": 1.0, "use_rts": False, "drop_tokens": False},
    {"k": 1, "capacity_factor": 4.0, "use_rts": False},
    {"k": 2, "capacity_factor": 0.5, "top2_2nd_expert_sampling": False},
    {"k": 2, "capacity_factor": 1.0, "top2_2nd_expert_sampling": False, "drop_tokens": False},
]
D, E = 6, 4


def _run(layer_cls: type, kwargs: dict, ep_size: int, rank: int) -> dict[str, list]:
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.ReLU(), torch.nn.Linear(8, D))
    layer = layer_cls(hidden_size=D, expert=expert, num_experts=E, ep_size=ep_size, min_capacity=1, **kwargs)
    if hasattr(layer, "set_deepspeed_parallelism"):  # DeepSpeed's: its engine hands the gate its ep group so
        layer.set_deepspeed_parallelism()  # drop_tokens=False agrees on one capacity (without: a gloo size error)
    local = E // ep_size
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(torch.randn(E, D, generator=gen))
        for g in range(E):  # every rank draws every expert's weights; it keeps its own
            values = [torch.randn(p.shape, generator=gen) for p in expert.parameters()]
            if g // local == rank % ep_size:
                for p, v in zip(
                    layer.deepspeed_moe.experts.deepspeed_experts[g % local].parameters(), values, strict=True
                ):
                    p.copy_(v)
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(100 + rank), requires_grad=True)
    out, l_aux, counts = layer(x)
    (out.square().sum() + l_aux).backward()
    grads = [p.grad.reshape(-1).tolist() for p in layer.deepspeed_moe.experts.parameters()]
    return {
        "out": out.reshape(-1).tolist(),
        "l_aux": [float(l_aux.detach())],
        "counts": [int(c) for c in counts],
        "x_grad": x.grad.reshape(-1).tolist(),
        "wg_grad": layer.deepspeed_moe.gate.wg.weight.grad.reshape(-1).tolist(),
        "expert_grads": grads,
    }


def _both(rank: int, world_size: int) -> list[tuple[dict, dict]]:
    deepspeed = import_deepspeed()
    from deepspeed.moe.layer import MoE as DsMoE

    from zeroshard.moe.layer import MoE

    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's all-to-all goes through its comm backend
    return [(_run(MoE, case, world_size, rank), _run(DsMoE, case, world_size, rank)) for case in CASES]


@pytest.mark.slow  # CI budget: the single-process reference parity stays in test_moe.py
@pytest.mark.parametrize("world_size", [1, 2])
def test_moe_layer_matches_deepspeed(world_size: int) -> None:
    for results in run_on_ranks(_both, world_size, timeout=300):
        for case, (ours, theirs) in zip(CASES, results, strict=True):
            assert ours["counts"] == theirs["counts"], case
            for key in ("out", "l_aux", "x_grad", "wg_grad"):
                _close(ours[key], theirs[key], f"{case} {key}")
            for a, b in zip(ours["expert_grads"], theirs["expert_grads"], strict=True):
                _close(a, b, f"{case} expert grads")


def _close(ours: list[float], theirs: list[float], what: str) -> None:
    """fp32 summation order differs (einsum paths): 1e-5 relative to the tensor's largest element."""
    a, b = torch.tensor(ours), torch.tensor(theirs)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()), msg=what)
