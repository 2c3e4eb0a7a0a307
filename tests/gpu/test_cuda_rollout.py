"""`zeroshard.runtime.rollout` on CUDA: a ZeRO-3 hybrid engine's rollouts, timed with CUDA events (`enable_profiling`),
and the continuous-batching and shared-prefill paths giving the whole-batch path's tokens on the GPU ([Note: rollout
through the training engine], [Note: continuous decode over the model's own cache]). fp32: the paths run the prompts
in batches of other sizes, and bf16 rounding could turn a near tie either way."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.hf_trainer import tiny_llama

pytestmark = pytest.mark.cuda

WORLD_SIZES = [1, 2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [1]
PAD, EOS, WIDTH, NEW = 0, 57, 6, 8
TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)


def _rollouts(rank: int, world_size: int) -> dict[str, Any]:
    import zeroshard
    from zeroshard.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
    from zeroshard.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

    config = {
        "train_micro_batch_size_per_gpu": 5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True},
    }
    engine, *_ = zeroshard.initialize(model=tiny_llama(), config=config)
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(1, 128, (5, WIDTH), generator=g)
    for row, length in enumerate((6, 2, 4, 1, 5)):
        ids[row, : WIDTH - length] = PAD
    request = RolloutRequest(ids.to(engine.device), (ids != PAD).long().to(engine.device))
    profiled = HybridEngineRollout(engine, TOKENIZER, cfg=HybridEngineRolloutConfig(enable_profiling=True))
    shared = HybridEngineRollout(engine, TOKENIZER, cfg=HybridEngineRolloutConfig(use_shared_prefill=True))
    engine.eval()
    out: dict[str, Any] = {"greedy": profiled.generate(request, SamplingConfig(max_new_tokens=NEW, temperature=0))}
    out["profile"] = profiled.get_last_profile()
    out["continuous"] = profiled.generate(
        request, SamplingConfig(max_new_tokens=NEW, temperature=0, continuous_batch_size=2)
    )
    out["continuous_profile"] = profiled.get_last_profile()
    sampled = SamplingConfig(max_new_tokens=NEW, temperature=1.0, top_k=8, n_samples_per_prompt=2)
    for name, rollout in (("sampled", profiled), ("shared", shared)):
        torch.manual_seed(100 + rank)
        torch.cuda.manual_seed(100 + rank)
        out[name] = rollout.generate(request, sampled)
    engine.destroy()
    return {k: (v.input_ids.cpu(), v.attention_mask.cpu()) if hasattr(v, "input_ids") else v for k, v in out.items()}


def _responses(ids: torch.Tensor) -> list[list[int]]:
    rows = []
    for row in ids[:, WIDTH:].tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return rows


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rollouts_on_cuda(world_size: int) -> None:
    for out in run_on_ranks(_rollouts, world_size):
        assert out["greedy"][0].shape == (5, WIDTH + NEW)
        assert _responses(out["continuous"][0]) == _responses(out["greedy"][0])
        assert torch.equal(out["sampled"][0], out["shared"][0])
        profile = out["profile"]
        assert profile["num_decode_forwards"] == NEW - 1
        assert 0.0 < profile["prefill_forward_ms"] + profile["decode_forward_ms"] <= profile["generation_ms"]
        assert out["continuous_profile"]["num_prefill_forwards"] >= 3
