"""[Note: gathering calls agree first] at stages 0-2, across engines, and around `load_module_state_dict`, with gloo's
per-collective fingerprints off (ZEROSHARD_VERIFY_COLLECTIVES=0) as NCCL has none: reads that would all-gather buffers
of the same sizes from different parameters (two parts of a torch_autocast split, two engines of one architecture),
a lone consolidated state dict or MoE save, and a module load that failed on one rank are named, not paired."""

from __future__ import annotations

import datetime
import os
from typing import Any

import pytest
import torch
from torch import nn

from helpers.harness import run_on_ranks
from helpers.outcomes import outcome as _outcome
from helpers.parity import Case, build_model, ds_config, param_groups

_GROUP_TIMEOUT = {"collective_timeout_s": 6}  # the store's timeout too: how long an absent rank is waited for


def _engine(stage: int) -> Any:
    os.environ["ZEROSHARD_VERIFY_COLLECTIVES"] = "0"
    os.environ["ZEROSHARD_DIVERGENCE_TIMEOUT_S"] = "3"
    import zeroshard

    case = Case(stage=stage)
    model = build_model(case)
    config = {**ds_config(case), "zeroshard": _GROUP_TIMEOUT}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    return engine


class _EmbedThenLinear(nn.Module):
    """Under torch_autocast the embedding (not lower-precision safe) and the linear land in two parts of one split
    strategy, each with a "group 0, bucket 0" of 16 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 4)
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(x)).sum()


def _same_sized_reads(rank: int, world_size: int) -> dict[str, tuple[str, str, float]]:
    os.environ["ZEROSHARD_VERIFY_COLLECTIVES"] = "0"
    import zeroshard
    from zeroshard import utils

    torch.manual_seed(0)
    model = _EmbedThenLinear()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "zeroshard": _GROUP_TIMEOUT,
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert len(engine.strategy.parts) == 2
    out = {"parts": _outcome(lambda: utils.safe_get_full_fp32_param((model.lin if rank == 0 else model.emb).weight))}
    actor, reference = _engine(2), _engine(2)  # one architecture: the same names, buckets and sizes
    weight = (actor if rank == 0 else reference).module.blocks[0].attn.qkv.weight
    out["engines"] = _outcome(lambda: utils.safe_get_full_fp32_param(weight))
    return out


def test_reads_of_same_sized_buffers_of_different_parameters_are_named() -> None:
    for out in run_on_ranks(_same_sized_reads, 2, timeout=120):
        name, message, seconds = out["parts"]
        assert name == "CollectiveMismatchError" and seconds < 5, out
        assert "of lin.weight" in message and "of emb.weight" in message, message
        name, message, seconds = out["engines"]
        assert name == "CollectiveMismatchError" and seconds < 5, out
        assert message.count("blocks.0.attn.qkv.weight") == 2 and "engine" in message, message


def _alone(rank: int, world_size: int, call: str) -> tuple[str, str, float] | None:
    from torch.distributed import distributed_c10d

    if call == "moe save":
        import zeroshard
        from helpers.moe_parity import MoeCase, MoeNet, config

        os.environ["ZEROSHARD_VERIFY_COLLECTIVES"] = "0"
        zeroshard.init_distributed(timeout=datetime.timedelta(seconds=6))
        model = MoeNet(MoeCase(stage=2), ep_size=2)
        settings = {**config(MoeCase(stage=2)), "zeroshard": _GROUP_TIMEOUT}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=settings)
    else:
        engine = _engine(2)
    store = distributed_c10d._get_default_store()
    if rank == 1:  # waits on the store, never in the call (a barrier would time out first)
        store.wait(["alone done"], datetime.timedelta(seconds=60))
        return None
    if call == "moe save":
        outcome = _outcome(lambda: engine.save_16bit_model(os.environ["ALONE_DIR"]))
    else:
        outcome = _outcome(engine.consolidated_state_dict)
    store.set("alone done", "1")
    return outcome


@pytest.mark.slow  # default-suite budget: moved 2026-11-30 (thirty-fifth session; a timeout each)
def test_a_lone_consolidated_state_dict_or_moe_save_names_the_absent_rank(tmp_path) -> None:
    os.environ["ALONE_DIR"] = str(tmp_path)
    try:
        for call, what in [("consolidated", "the consolidated state dict"), ("moe save", "the full state dict")]:
            name, message, seconds = run_on_ranks(_alone, 2, call, timeout=120)[0]
            assert name == "CollectiveTimeoutError", (call, name, message)
            assert f"rank 0 made {what}" in message and "rank(s) [1]" in message, message
            assert 6 <= seconds < 30, seconds
    finally:
        del os.environ["ALONE_DIR"]


def _failed_load(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    engine = _engine(stage)
    import zeroshard

    with zeroshard.GatheredParameters(list(engine.module.parameters())):
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    state = {k: v.detach().clone() + 1.0 for k, v in engine.module.state_dict().items()}  # tied names included
    if rank == 1:
        state.pop("wte.weight")  # this rank's checkpoint lacks a key: its strict load fails
    outcome = _outcome(lambda: engine.load_module_state_dict({"module": state}))
    with zeroshard.GatheredParameters(list(engine.module.parameters())):
        unchanged = all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    masters = zeroshard.utils.safe_get_full_fp32_param(engine.module.wte.weight)
    return {"outcome": outcome, "unchanged": unchanged, "masters": torch.equal(masters, before["wte.weight"])}


def test_a_module_load_that_failed_on_one_rank_fails_on_every_rank_and_changes_nothing() -> None:
    for stage in (2, 3):
        first, second = run_on_ranks(_failed_load, 2, stage, timeout=120)
        name, message, seconds = first["outcome"]
        assert name == "ZeroshardError" and "failed on rank(s) [1]" in message and seconds < 5, (stage, first)
        name, message, _ = second["outcome"]
        assert name == "ZeroshardError" and "missing keys ['wte.weight']" in message, (stage, second)
        for got in (first, second):
            assert got["unchanged"] and got["masters"], (stage, got)
