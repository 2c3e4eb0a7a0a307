"""`SamplingConfig.continuous_batch_size` ([Note: continuous decode over the model's own cache]): every row decodes
what the whole-batch greedy `generate` gives it (that path is DeepSpeed's token for token: test_rollout.py), whatever
the number of live rows, with trimming, with aligned fronts and with the model's repetition penalty; the statistics
and refusals. DeepSpeed 0.19.8's own continuous path fails with transformers 5 (its static cache lacks
`get_query_offset`), so the whole-batch path is the reference here."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zeroshard.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig
from zeroshard.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

EOS, PAD, NEW = 9, 0, 12
TOKENIZER = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)


def _model(**config: Any) -> LlamaForCausalLM:
    torch.manual_seed(0)
    settings: dict[str, Any] = {
        "vocab_size": 16,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "bos_token_id": 1,
    }
    return LlamaForCausalLM(LlamaConfig(**{**settings, **config})).eval()


def _request() -> RolloutRequest:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 16, (7, 6), generator=g)
    lengths = [6, 2, 4, 1, 6, 3, 5]
    for row, length in enumerate(lengths):
        ids[row, : 6 - length] = PAD
    return RolloutRequest(ids, (ids != PAD).long())


def _rollout(model: Any, sampling: SamplingConfig, **cfg: Any) -> tuple[Any, HybridEngineRollout]:
    rollout = HybridEngineRollout(SimpleNamespace(module=model), TOKENIZER, cfg=HybridEngineRolloutConfig(**cfg))
    return rollout.generate(_request(), sampling), rollout


def _responses(batch: Any) -> list[list[int]]:
    """Each row's response up to its first EOS (included), as the whole-batch path pads after it."""
    out = []
    for row in batch.input_ids[:, 6:].tolist():
        out.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return out


@pytest.mark.parametrize(
    "cfg",
    [{}, {"enable_cache_trimming": True}, {"align_decode_fronts": True}, {"continuous_cache_capacity": 6 + NEW - 1}],
    ids=["plain", "trimming", "aligned", "capacity"],
)
def test_each_row_decodes_as_the_whole_batch(cfg: dict[str, Any]) -> None:
    model = _model()
    whole, _ = _rollout(model, SamplingConfig(max_new_tokens=NEW, temperature=0))
    expected = _responses(whole)
    assert any(EOS in r for r in expected) and any(EOS not in r for r in expected)  # rows retire early and late
    for rows in (1, 3, 7):
        batch, rollout = _rollout(
            model, SamplingConfig(max_new_tokens=NEW, temperature=0, continuous_batch_size=rows), **cfg
        )
        longest = max(len(r) for r in expected)
        assert batch.input_ids.shape == (7, 6 + longest)
        assert batch.response_start_idx.tolist() == [6] * 7
        for row, response in enumerate(expected):
            assert batch.input_ids[row, 6 : 6 + len(response)].tolist() == response, (rows, row)
            assert batch.input_ids[row, 6 + len(response) :].eq(PAD).all()
            attended = [1] * len(response) + [0] * (longest - len(response))
            assert batch.attention_mask[row].tolist() == _request().prompt_attention_mask[row].tolist() + attended
        stats = rollout.get_last_continuous_stats()
        assert stats is not None and stats["peak_cache_length"] <= stats["cache_capacity"]
        if cfg and rows == 3:  # rows retire while others decode: the columns only they held are dropped
            assert stats["trim_count"] > 0 and stats["trimmed_columns"] > 0, stats


def test_the_models_repetition_penalty_as_generate_applies_it() -> None:
    model = _model()
    model.generation_config.repetition_penalty = 1.7
    whole, _ = _rollout(model, SamplingConfig(max_new_tokens=NEW, temperature=0))
    batch, _ = _rollout(model, SamplingConfig(max_new_tokens=NEW, temperature=0, continuous_batch_size=2))
    assert _responses(batch) == _responses(whole)
    model.generation_config.repetition_penalty = 1.0
    plain, _ = _rollout(model, SamplingConfig(max_new_tokens=NEW, temperature=0))
    assert _responses(plain) != _responses(whole)  # the penalty changed the tokens


def test_a_full_cache_is_one_line() -> None:
    sampling = SamplingConfig(max_new_tokens=NEW, temperature=0, continuous_batch_size=3)
    with pytest.raises(ValueError, match=r"capacity \(8\) is exhausted .* max_new_tokens - 1 \(17\)"):
        _rollout(_model(), sampling, continuous_cache_capacity=8)
    with pytest.raises(ValueError, match="continuous_cache_capacity 4 is below the prompt width 6"):
        _rollout(_model(), sampling, continuous_cache_capacity=4)


def test_profiling_and_statistics_carry_deepspeeds_keys() -> None:
    sampling = SamplingConfig(max_new_tokens=NEW, temperature=0, continuous_batch_size=3)
    _, rollout = _rollout(_model(), sampling, enable_profiling=True)
    profile, stats = rollout.get_last_profile(), rollout.get_last_continuous_stats()
    assert profile is not None and stats is not None
    assert profile["num_prefill_forwards"] >= 3 and profile["num_decode_forwards"] == stats["decode_steps"] > 0
    assert profile["active_batch_size"] == profile["continuous_batch_size"] == 3
    spent = sum(profile[k] for k in ("prefill_forward_ms", "decode_forward_ms", "scheduler_overhead_ms"))
    assert 0.0 < spent + profile["cache_management_overhead_ms"] <= profile["generation_ms"]
    # DeepSpeed 0.19.8's keys (_finish_continuous_profile; the statistics of _generate_continuous)
    assert set(profile) == {
        "prompt_expansion_ms", "generation_ms", "prefill_forward_ms", "decode_forward_ms", "generation_overhead_ms",
        "num_prefill_forwards", "num_decode_forwards", "scheduler_overhead_ms", "cache_management_overhead_ms",
        "post_processing_ms", "total_ms", "num_generated_tokens", "tokens_per_second", "batch_size",
        "num_samples_per_prompt", "prompt_length", "response_length", "active_batch_size", "continuous_batch_size",
    }  # fmt: skip
    assert set(stats) == {
        "cache_capacity", "peak_cache_length", "cache_memory_bytes", "trim_count", "trimmed_columns",
        "trim_latency_ms", "decode_steps", "trim_frequency", "end_to_end_ms", "tokens_per_second", "trim_bytes_moved",
    }  # fmt: skip
    assert stats["end_to_end_ms"] > 0 and stats["tokens_per_second"] > 0
    _, quiet = _rollout(_model(), sampling)
    quiet_stats = quiet.get_last_continuous_stats()
    assert quiet_stats is not None and quiet_stats["end_to_end_ms"] is None and quiet_stats["tokens_per_second"] is None


def test_generation_config_processors_it_does_not_apply_are_refused() -> None:
    sampling = SamplingConfig(max_new_tokens=NEW, temperature=0, continuous_batch_size=2)
    for name, value in (("no_repeat_ngram_size", 2), ("suppress_tokens", [3, 5]), ("forced_eos_token_id", 4)):
        model = _model()
        setattr(model.generation_config, name, value)
        with pytest.raises(ValueError, match=f"generation_config.{name}=.* reset it, or decode without"):
            _rollout(model, sampling)
    with pytest.raises(ValueError, match="continuous_cache_capacity 0 is below the prompt width 6"):
        _rollout(_model(), sampling, continuous_cache_capacity=0)


@pytest.mark.parametrize(
    ("sampling", "cfg", "words"),
    [
        ({"temperature": 1.0}, {}, "greedy decoding only"),
        ({"n_samples_per_prompt": 2}, {}, "one sample per prompt only"),
        ({}, {"use_shared_prefill": True}, "not with use_shared_prefill"),
        ({"continuous_batch_size": 0}, {}, "must be positive, got 0"),
        ({"max_new_tokens": 0}, {}, "max_new_tokens must be positive"),
    ],
)
def test_refused_before_any_work(sampling: dict[str, Any], cfg: dict[str, Any], words: str) -> None:
    settings = {"max_new_tokens": NEW, "temperature": 0.0, "continuous_batch_size": 2, **sampling}
    model = _model()
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=f"^SamplingConfig.continuous_batch_size: {words}"):
        _rollout(model, SamplingConfig(**settings), **cfg)
    assert not calls


def test_an_empty_prompt_and_a_sliding_window_are_refused() -> None:
    rollout = HybridEngineRollout(SimpleNamespace(module=_model()), TOKENIZER)
    sampling = SamplingConfig(max_new_tokens=NEW, temperature=0, continuous_batch_size=2)
    ids = torch.tensor([[PAD, PAD], [3, 4]])
    with pytest.raises(ValueError, match="every prompt needs at least one attended token"):
        rollout.generate(RolloutRequest(ids, (ids != PAD).long()), sampling)
    sliding = _model(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    with pytest.raises(ValueError, match="not all full attention"):
        HybridEngineRollout(SimpleNamespace(module=sliding), TOKENIZER).generate(_request(), sampling)
