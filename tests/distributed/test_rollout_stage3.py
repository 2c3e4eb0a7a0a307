"""`zeroshard.runtime.rollout` on a ZeRO-3 engine on 2 gloo ranks, each rank with prompts of its own: the whole-batch
greedy rollout, a continuous-batching one whose rows finish at different steps on each rank (the model is gathered
once for the decode: [Note: continuous decode over the model's own cache]) and a shared-prefill sampled one (which
DeepSpeed refuses at stage 3) all give what one process gives with the same weights; the engine trains after them.
The whole-batch path against DeepSpeed's on the same loop: tests/compat/scripts/opsd_rollout.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from helpers.harness import run_on_ranks
from helpers.hf_trainer import tiny_llama

PAD, EOS, WIDTH, NEW = 0, 57, 6, 8
TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)


def _prompts(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(1, 32, (5, WIDTH), generator=g)
    for row, length in enumerate((6, 2, 4, 1, 5)):
        ids[row, : WIDTH - length] = PAD
    return ids, (ids != PAD).long()


def _run(engine: Any, rank: int) -> dict[str, Any]:
    from zeroshard.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
    from zeroshard.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

    request = RolloutRequest(*_prompts(rank))
    plain = HybridEngineRollout(engine, TOKENIZER)
    shared = HybridEngineRollout(engine, TOKENIZER, cfg=HybridEngineRolloutConfig(use_shared_prefill=True))
    out: dict[str, Any] = {"greedy": plain.generate(request, SamplingConfig(max_new_tokens=NEW, temperature=0))}
    rows = 1 + rank  # ranks decode different numbers of steps
    out["continuous"] = plain.generate(
        request, SamplingConfig(max_new_tokens=NEW, temperature=0, continuous_batch_size=rows)
    )
    sampled = SamplingConfig(max_new_tokens=NEW, temperature=1.0, top_k=8, n_samples_per_prompt=2)
    for name, rollout in (("sampled", plain), ("shared", shared)):
        torch.manual_seed(100 + rank)
        out[name] = rollout.generate(request, sampled)
    out["decode_steps"] = plain.get_last_continuous_stats()
    return out


def _ranks(rank: int, world_size: int) -> dict[str, Any]:
    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": 5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zeroshard.initialize(model=tiny_llama(), config=config)
    weights = {k: v.clone() for k, v in engine.module_state_dict().items()}
    engine.eval()
    out = _run(engine, rank)
    engine.train()
    batch = out["greedy"]
    loss = engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.input_ids).loss
    engine.backward(loss)
    engine.step()
    out["loss"] = loss.item()
    out["weights"] = weights if rank == 0 else None
    engine.destroy()
    return out


def _rows(batch: Any) -> list[list[int]]:
    rows = []
    for row in batch.input_ids[:, WIDTH:].tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return rows


def test_rollouts_on_stage_3_are_one_process_rollouts() -> None:
    from zeroshard.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig

    results = run_on_ranks(_ranks, 2)
    model = tiny_llama()
    model.load_state_dict(results[0]["weights"])
    alone = HybridEngineRollout(SimpleNamespace(module=model.eval()), TOKENIZER)
    for rank, out in enumerate(results):
        expected = alone.generate(RolloutRequest(*_prompts(rank)), SamplingConfig(max_new_tokens=NEW, temperature=0))
        assert torch.equal(out["greedy"].input_ids, expected.input_ids), rank
        assert torch.equal(out["greedy"].attention_mask, expected.attention_mask), rank
        assert _rows(out["continuous"]) == _rows(expected), rank
        assert torch.equal(out["sampled"].input_ids, out["shared"].input_ids), rank
        assert torch.equal(out["sampled"].attention_mask, out["shared"].attention_mask), rank
        assert torch.isfinite(torch.tensor(out["loss"])), rank
    assert results[0]["decode_steps"]["decode_steps"] != results[1]["decode_steps"]["decode_steps"]
    assert any(EOS in r for r in _rows(results[0]["greedy"]) + _rows(results[1]["greedy"]))
