"""MoE gating against hand-computed values (capacity, dropping, the load-balancing loss), the expert mesh's rank
arithmetic, the layer on one process against a loop over tokens, and the arguments it refuses."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from zeroshard.moe import ExpertMesh, MoE, top1gating, top2gating
from zeroshard.moe.gating import capacity_for, topkgating

# 4 tokens, 2 experts: tokens 0, 1 and 3 prefer expert 0, token 2 expert 1
LOGITS = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [3.0, 0.0]])


def _softmax(row: list[float]) -> list[float]:
    e = [math.exp(v) for v in row]
    return [v / sum(e) for v in e]


def test_capacity():
    assert capacity_for(8, 4, 1.0, 4) == 4  # ceil(2.0) raised to min_capacity
    assert capacity_for(8, 4, 1.5, 1) == 3
    assert capacity_for(5, 2, 1.0, 0) == 3
    assert capacity_for(4, 8, 1.0, 0) == 1


def test_top1_drops_past_capacity_in_token_order():
    out = top1gating(LOGITS, capacity_factor=1.0, min_capacity=1, use_rts=False)
    assert out.capacity == 2  # ceil(4 / 2 * 1.0)
    assert out.exp_counts.tolist() == [3, 1]  # before dropping
    gates = [_softmax(r) for r in LOGITS.tolist()]
    want = torch.zeros(4, 2, 2)
    want[0, 0, 0], want[1, 0, 1], want[2, 1, 0] = gates[0][0], gates[1][0], gates[2][1]  # token 3 dropped
    torch.testing.assert_close(out.combine, want)
    assert out.dispatch.equal(want.bool())
    me = [sum(g[e] for g in gates) / 4 for e in range(2)]
    ce = [3 / 4, 1 / 4]
    assert out.l_aux.item() == pytest.approx(2 * (me[0] * ce[0] + me[1] * ce[1]), rel=1e-6)


def test_top1_without_dropping_keeps_every_token():
    out = top1gating(LOGITS, capacity_factor=1.0, min_capacity=1, drop_tokens=False, use_rts=False)
    assert out.capacity == 3  # the largest expert load
    assert out.combine[3, 0, 2].item() == pytest.approx(_softmax([3.0, 0.0])[0])
    assert out.dispatch.sum().item() == 4


def test_top1_random_token_selection_keeps_capacity_tokens():
    out = top1gating(LOGITS, capacity_factor=1.0, min_capacity=1, use_rts=True)
    assert out.dispatch[:, 0].sum().item() == 2 and out.dispatch[2, 1].any()


def test_top2_first_choices_fill_first_and_weights_renormalise():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 0.0, 1.0]])
    out = top2gating(logits, capacity_factor=0.5, min_capacity=0, second_expert_sampling=False)
    assert out.capacity == 1  # ceil(2 / 3 * 0.5 * 2)
    assert out.exp_counts.tolist() == [2, 1, 1]
    g0, g1 = _softmax([2.0, 1.0, 0.0]), _softmax([2.0, 0.0, 1.0])
    want = torch.zeros(2, 3, 1)
    want[0, 0, 0] = g0[0] / (g0[0] + g0[1])  # token 0: both choices kept
    want[0, 1, 0] = g0[1] / (g0[0] + g0[1])
    want[1, 2, 0] = 1.0  # token 1: its first choice (expert 0) is full, its second keeps all the weight
    torch.testing.assert_close(out.combine, want)
    me0 = (g0[0] + g1[0]) / 2
    assert out.l_aux.item() == pytest.approx(3 * 3 * (me0 * 1.0) / 3, rel=1e-6)


def test_top2_without_dropping():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 0.0, 1.0]])
    out = top2gating(logits, capacity_factor=0.5, min_capacity=0, drop_tokens=False, second_expert_sampling=False)
    assert out.capacity == 2 and out.dispatch.sum().item() == 4


def test_expert_mesh():
    mesh = ExpertMesh(world_size=4, ep_size=2)
    assert mesh.ep_groups() == [[0, 1], [2, 3]]
    assert mesh.edp_groups() == [[0, 2], [1, 3]]
    assert (mesh.edp_size, mesh.ep_rank(3), mesh.edp_rank(3)) == (2, 1, 1)
    with pytest.raises(ValueError, match="must divide"):
        ExpertMesh(world_size=4, ep_size=3)


def test_expert_mesh_data_before_expert():
    """use_data_before_expert_parallelism, DeepSpeed's "D + E" (its groups.py docstring's 16 ranks, ep 2): expert-data
    groups of consecutive ranks, expert groups strided; in a pipeline stage from its first rank."""
    mesh = ExpertMesh(world_size=16, ep_size=2, data_first=True)
    assert mesh.edp_groups() == [list(range(8)), list(range(8, 16))]
    assert mesh.ep_groups() == [[i, i + 8] for i in range(8)]
    assert (mesh.ep_rank(9), mesh.edp_rank(9), mesh.edp_root(9)) == (1, 1, 8)
    stage = ExpertMesh(world_size=4, ep_size=2, base=4, data_first=True)  # pp stage 2 of 2, 4 ranks each
    assert (stage.edp_groups(), stage.ep_groups()) == ([[4, 5], [6, 7]], [[4, 6], [5, 7]])
    assert (stage.ep_rank(6), stage.edp_rank(6), stage.edp_root(7)) == (1, 0, 6)
    assert ExpertMesh(world_size=4, ep_size=2).edp_root(3) == 1  # "E + D": the group {1, 3}


@pytest.mark.parametrize("k", [2, 3])
def test_layer_matches_a_loop_over_tokens(k):
    torch.manual_seed(0)
    experts = k + 1
    layer = MoE(4, nn.Linear(4, 4), num_experts=experts, k=k, min_capacity=0, top2_2nd_expert_sampling=False)
    for i, expert in enumerate(layer.experts.deepspeed_experts):
        nn.init.normal_(expert.weight, std=1.0 + i)
    x = torch.randn(2, 5, 4)
    out, l_aux, counts = layer(x)
    logits = layer.gate.wg(x.reshape(-1, 4))
    gate = top2gating(logits, 1.0, 0, second_expert_sampling=False) if k == 2 else topkgating(logits, k, 1.0, 0)
    tokens = x.reshape(-1, 4)
    want = torch.stack(
        [
            sum(gate.combine[s, e].sum() * layer.experts.deepspeed_experts[e](tokens[s]) for e in range(experts))
            for s in range(10)
        ]
    )
    torch.testing.assert_close(out.reshape(-1, 4), want)
    assert counts.tolist() == gate.exp_counts.tolist() and l_aux.item() == pytest.approx(gate.l_aux.item())
    assert "deepspeed_moe.gate.wg.weight" in layer.state_dict()
    assert f"deepspeed_moe.experts.deepspeed_experts.{k}.weight" in layer.state_dict()


def test_used_token_masks_tokens_at_top1():
    torch.manual_seed(0)
    layer = MoE(4, nn.Linear(4, 4), num_experts=2, k=1, min_capacity=0, capacity_factor=2.0, use_rts=False)
    x = torch.randn(6, 4)
    used = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    out, _, counts = layer(x, used)
    assert counts.sum().item() == 4 and out[1].abs().sum() == 0 and out[3].abs().sum() == 0
    assert out[0].abs().sum() > 0
    with pytest.raises(ValueError, match="only top-1 gating masks tokens"):
        MoE(4, nn.Linear(4, 4), num_experts=2, k=2)(x, used)


def test_residual_moe_runs():
    layer = MoE(4, nn.Linear(4, 4), num_experts=2, use_residual=True)
    out, _, _ = layer(torch.randn(3, 4))
    assert out.shape == (3, 4) and "coefficient.weight" in layer.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"use_tutel": True}, "Tutel"),
        ({"enable_expert_tensor_parallelism": True}, "expert tensor parallelism"),
        ({"k": 3}, "choose k from 1 to num_experts"),
        ({"num_experts": 3, "ep_size": 2}, "multiple of ep_size"),
        ({"noisy_gate_policy": "Gaussian"}, "noisy_gate_policy"),
    ],
)
def test_refused_arguments(kwargs, message):
    args = {"hidden_size": 4, "expert": nn.Linear(4, 4), "num_experts": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        MoE(**args)


def test_deepspeed_import_path():
    from zeroshard.moe.layer import MoE as LayerMoE

    assert LayerMoE is MoE


def test_split_params_helper_keeps_the_groups():
    from zeroshard.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    layer = MoE(4, nn.Linear(4, 4), num_experts=2)
    group = {"params": list(layer.parameters()), "lr": 0.1}
    assert split_params_into_different_moe_groups_for_optimizer(group) == [group]
    assert is_moe_param(layer.experts.deepspeed_experts[1].weight, layer)
    assert not is_moe_param(layer.gate.wg.weight, layer)


def test_gumbel_noise_spreads_sampled_choices():
    # Before, the noise was NaN: RSample sent every token to expert 0, top-2's sampled second choice to the first
    # expert not already chosen. With equal logits both choices spread over the experts.
    from zeroshard.moe.gating import gumbel

    torch.manual_seed(0)
    assert torch.isfinite(gumbel(torch.Size([64, 4]), torch.device("cpu"))).all()
    logits = torch.zeros(4000, 4)
    rsample = top1gating(logits, 1.0, 0, noisy_gate_policy="RSample", drop_tokens=False).exp_counts
    assert rsample.min() > 900, rsample.tolist()
    second = top2gating(logits, 1.0, 0, drop_tokens=False, second_expert_sampling=True).exp_counts
    first = torch.bincount(logits.argmax(dim=1), minlength=4)  # all expert 0
    assert (second - first)[1:].min() > 1200, (second - first).tolist()


def test_sampled_gating_equals_deepspeeds_draws():
    """The same generator state gives DeepSpeed 0.19.8's choices, weights and loss to the bit."""
    sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")
    torch.manual_seed(0)
    logits = torch.randn(512, 4) * 0.3
    for drop_tokens in (True, False):
        torch.manual_seed(1)
        want = sharded_moe.top2gating(logits.clone(), 1.0, 0, drop_tokens=drop_tokens)
        torch.manual_seed(1)
        got = top2gating(logits.clone(), 1.0, 0, drop_tokens=drop_tokens)
        assert torch.equal(got.combine, want[1]) and torch.equal(got.l_aux, want[0]), drop_tokens
        torch.manual_seed(1)
        want = sharded_moe.top1gating(logits.clone(), 1.0, 0, noisy_gate_policy="RSample", drop_tokens=drop_tokens)
        torch.manual_seed(1)
        got = top1gating(logits.clone(), 1.0, 0, noisy_gate_policy="RSample", drop_tokens=drop_tokens, use_rts=False)
        assert torch.equal(got.exp_counts, want[3]), drop_tokens
