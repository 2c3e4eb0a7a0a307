""" "Rank 0's values on every rank" where a parameter is held alike by a group that is not the world (4 gloo ranks).

`load_module_state_dict` (DeepSpeed's `modifier_rank=0`) and `GatheredParameters(modifier_rank=0)` broadcast from a
rank of the group that holds each parameter alike, counted in that group, as DeepSpeed counts `modifier_rank` in a
parameter's data-parallel group: under tensor parallelism (tp2 x dp2: tp groups {0,1},{2,3}, dp groups {0,2},{1,3})
each tensor-parallel rank's slice comes from dp rank 0 of its position (global rank t for position t); MoE experts
(ep2: expert-data-parallel groups {0,2},{1,3}) come from their expert-data-parallel group's first rank, the dense
parameters from rank 0. Before, the broadcasts named global rank 0 on every group (ranks outside it raised "not
part of group", the DTensors raised, and the experts of ep rank 1 were overwritten with ep rank 0's).

Each rank loads its own state dict shifted by its global rank (or fills the gathered parameter with its rank), so
the values after the call say whose they are.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks

TP = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _shifted_load(engine: Any, rank: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, local values before, after) of every parameter, each rank loading its state dict plus its rank."""
    before = {n: _local(p) for n, p in engine.module.named_parameters()}
    state = {k: v.detach() + float(rank) for k, v in engine.module.state_dict().items()}
    engine.load_module_state_dict({"module": state})
    return [(n, before[n], _local(p)) for n, p in engine.module.named_parameters()]


def _sources(rank: int, world_size: int) -> dict[str, Any]:
    import zeroshard
    from helpers.moe_parity import MoeCase, MoeNet
    from helpers.moe_parity import config as moe_config
    from helpers.tp_parity import TpCase, config, llama
    from zeroshard.moe.zero import moe_layers

    zeroshard.init_distributed()
    out: dict[str, Any] = {}
    # tensor parallelism at ZeRO-1: each slice from dp rank 0 of its tensor-parallel position
    engine, *_ = zeroshard.initialize(model=llama(), config=config(TpCase(stage=1)))
    out["tp_load"] = [torch.allclose(after, before + rank % TP) for _, before, after in _shifted_load(engine, rank)]
    engine.destroy()
    # tensor parallelism on the fsdp2 backend: the modifier's gathered slice, on every data-parallel rank
    engine, *_ = zeroshard.initialize(model=llama(), config=config(TpCase(stage=3, backend="fsdp2")))
    attention = engine.module.model.layers[0].self_attn.q_proj
    with zeroshard.GatheredParameters([attention.weight], modifier_rank=0):
        with torch.no_grad():
            attention.weight.to_local().fill_(float(rank))  # the gathered (tensor-parallel slice) parameter
    after = _local(attention.weight)
    out["fsdp2_modifier"] = after.numel() > 0 and torch.equal(after, torch.full_like(after, float(rank % TP)))
    engine.destroy()
    # MoE experts (ep2, ZeRO-2): an expert from its expert-data-parallel group's first rank, the rest from rank 0
    case = MoeCase(k=2, stage=2, steps=1)
    model = MoeNet(case, 2)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=moe_config(case))
    experts = {n for layer in moe_layers(engine.module) for n, _ in layer.named_parameters() if ".experts." in n}
    loaded = _shifted_load(engine, rank)
    out["moe_experts"] = [torch.allclose(a, b + rank % 2) for n, b, a in loaded if any(n.endswith(e) for e in experts)]
    out["moe_dense"] = [torch.allclose(a, b) for n, b, a in loaded if not any(n.endswith(e) for e in experts)]
    engine.destroy()
    return out


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by rank 0's values:
# test_zero_init_ranks.py
@pytest.mark.slow
def test_rank_zero_values_come_from_the_group_that_holds_each_parameter() -> None:
    for rank, out in enumerate(run_on_ranks(_sources, 4, timeout=300)):
        assert out["tp_load"] and all(out["tp_load"]), (rank, out["tp_load"])
        assert out["fsdp2_modifier"], rank
        assert out["moe_experts"] and all(out["moe_experts"]), (rank, out["moe_experts"])
        assert out["moe_dense"] and all(out["moe_dense"]), (rank, out["moe_dense"])
