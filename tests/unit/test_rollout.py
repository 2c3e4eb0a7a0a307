"""`zeroshard.runtime.rollout` (DeepSpeed 0.19.8's `deepspeed.runtime.rollout`): DeepSpeed's own
`tests/unit/runtime/rollout/` cases with the import swapped, and each piece against DeepSpeed's on the same inputs:
the divergence and the response targets bit for bit, the slot scheduler transition by transition, and a whole
`generate` (greedy, sampled, several samples per prompt, EOS inside the responses) token for token."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.errors import ConfigError
from zeroshard.runtime.rollout import (
    RolloutBatch,
    RolloutConfig,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
    build_rollout,
)
from zeroshard.runtime.rollout.continuous_batching import ContinuousBatchRequest, ContinuousBatchScheduler
from zeroshard.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout, HybridEngineRolloutConfig
from zeroshard.runtime.rollout.opsd import ResponseTokenBatch, generalized_jsd_loss

EOS, PAD = 5, 0


# --- DeepSpeed's test_rollout_interface.py --------------------------------------------------------------------------


def test_requests_and_batches_refuse_bad_shapes() -> None:
    with pytest.raises(ValueError, match="must be 2-D"):
        RolloutRequest(prompt_ids=torch.zeros(8), prompt_attention_mask=torch.ones(8))
    with pytest.raises(ValueError, match="does not match"):
        RolloutRequest(prompt_ids=torch.zeros(2, 4, dtype=torch.long), prompt_attention_mask=torch.ones(2, 5))
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="must be 2-D"):
        RolloutBatch(
            input_ids=torch.zeros(8, dtype=torch.long),
            attention_mask=torch.ones(8),
            response_start_idx=torch.tensor([4]),
        )
    with pytest.raises(ValueError, match="does not match"):
        RolloutBatch(input_ids=ids, attention_mask=torch.ones(2, 5), response_start_idx=torch.tensor([4, 4]))
    with pytest.raises(ValueError, match="1-D of length"):
        RolloutBatch(input_ids=ids, attention_mask=torch.ones(2, 4), response_start_idx=torch.tensor([4]))
    batch = RolloutBatch(torch.zeros(3, 12, dtype=torch.long), torch.ones(3, 12), torch.tensor([4, 5, 6]))
    assert (batch.batch_size, batch.seq_len) == (3, 12)


def test_defaults_are_deepspeeds() -> None:
    ds = import_deepspeed("deepspeed.runtime.rollout")
    ds_he = import_deepspeed("deepspeed.runtime.rollout.hybrid_engine_rollout")
    for ours, theirs in (
        (SamplingConfig(max_new_tokens=32), ds.SamplingConfig(max_new_tokens=32)),
        (RolloutConfig(), ds.RolloutConfig()),
        (HybridEngineRolloutConfig(), ds_he.HybridEngineRolloutConfig()),
    ):
        assert vars(ours) == vars(theirs)


class FakeRollout(RolloutEngine):
    """DeepSpeed's test stub: each prompt followed by `max_new_tokens` copies of one token."""

    name = "fake"

    def __init__(self) -> None:
        self.sync_calls: list[int] = []

    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        rows, width = request.prompt_ids.shape
        n, new = sampling.n_samples_per_prompt, sampling.max_new_tokens
        ids = torch.cat([request.prompt_ids.repeat_interleave(n, 0), torch.full((rows * n, new), 42)], dim=1)
        mask = torch.cat([request.prompt_attention_mask.repeat_interleave(n, 0), torch.ones(rows * n, new)], dim=1)
        return RolloutBatch(ids, mask, torch.full((rows * n,), width, dtype=torch.long))

    def sync_weights(self, step: int) -> None:
        self.sync_calls.append(step)


def test_a_trainers_own_engine_conforms() -> None:
    fake = FakeRollout()
    req = RolloutRequest(torch.tensor([[1, 2], [3, 4]]), torch.ones(2, 2, dtype=torch.long))
    out = fake.generate(req, SamplingConfig(max_new_tokens=3, n_samples_per_prompt=4))
    assert out.input_ids.shape == (8, 5) and out.response_start_idx.tolist() == [2] * 8
    fake.sync_weights(0)
    fake.sync_weights(5)
    assert fake.sync_calls == [0, 5] and fake.shutdown() is None


def test_build_rollout_refuses_in_one_line() -> None:
    with pytest.raises(ValueError, match="Unknown rollout engine 'totally_made_up'"):
        build_rollout(RolloutConfig(engine="totally_made_up"))
    with pytest.raises(ValueError, match="needs both"):
        build_rollout(RolloutConfig(engine="hybrid_engine"))


# --- DeepSpeed's test_hybrid_engine_rollout.py (the cases its 0.19.8 holds) -----------------------------------------


def test_constructor_takes_any_config_object() -> None:
    engine, tok = MagicMock(), SimpleNamespace(pad_token_id=0, eos_token_id=2)
    rollout = HybridEngineRollout(engine, tok, cfg=HybridEngineRolloutConfig(use_graph_capture=True))
    assert rollout.use_graph_capture is True and rollout.engine is engine and rollout.tokenizer is tok
    assert HybridEngineRollout(engine, tok).use_graph_capture is False
    # a trainer's RolloutConfig subclass: the fields it lacks take their defaults
    assert HybridEngineRollout(engine, tok, cfg=RolloutConfig()).enable_profiling is False
    assert HybridEngineRollout(engine, tok).sync_weights(step=0) is None


def test_greedy_graph_capture_dispatches_and_is_refused_here() -> None:
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    rollout = HybridEngineRollout(MagicMock(), tok, cfg=HybridEngineRolloutConfig(use_graph_capture=True))
    req = RolloutRequest(torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.long))
    greedy = SamplingConfig(max_new_tokens=3, temperature=0)
    with pytest.raises(ConfigError, match="^use_graph_capture: .*set it false"):
        rollout.generate(req, greedy)
    rollout._generate_graph = MagicMock(return_value=torch.zeros(1, 5, dtype=torch.long))  # type: ignore[method-assign]
    rollout.generate(req, greedy)
    rollout._generate_graph.assert_called_once()
    graph = HybridEngineRollout(MagicMock(), tok, cfg=HybridEngineRolloutConfig(use_graph_capture=True))
    with pytest.raises(ConfigError, match="^use_graph_capture: "):  # the continuous decode captures none either
        graph.generate(req, SamplingConfig(max_new_tokens=3, temperature=0, continuous_batch_size=2))


# --- the pieces against DeepSpeed's ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"beta": 0.0},
        {"beta": 1.0},
        {"beta": 0.3, "temperature": 0.7},
        {"beta": 0.5, "teacher_top_k": 4},
        {"beta": 0.9, "pointwise_clip": 0.01, "temperature": 2.0},
    ],
)
def test_generalized_jsd_is_deepspeeds_bit_for_bit(kwargs: dict[str, Any]) -> None:
    ds = import_deepspeed("deepspeed.runtime.rollout.opsd")
    g = torch.Generator().manual_seed(len(str(kwargs)))
    student = torch.randn(3, 7, 11, generator=g, requires_grad=True)
    teacher = torch.randn(3, 7, 11, generator=g)
    mask = torch.rand(3, 7, generator=g) > 0.3
    ours = generalized_jsd_loss(student, teacher, mask, **kwargs)
    theirs = ds.generalized_jsd_loss(student, teacher, mask, **kwargs)
    for name in ("loss", "loss_sum", "valid_token_count"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    (grad,) = torch.autograd.grad(ours.loss, student)
    (ds_grad,) = torch.autograd.grad(theirs.loss, student)
    assert torch.equal(grad, ds_grad)


def test_generalized_jsd_refuses_bad_arguments() -> None:
    s, m = torch.zeros(1, 2, 3), torch.ones(1, 2)
    for kwargs, words in (
        ({"beta": 1.5}, "beta must be in"),
        ({"temperature": 0.0}, "temperature must be positive"),
        ({"teacher_top_k": 4}, "teacher_top_k must be positive"),
        ({"pointwise_clip": -1.0}, "pointwise_clip must be non-negative"),
    ):
        with pytest.raises(ValueError, match=words):
            generalized_jsd_loss(s, s, m, **kwargs)
    with pytest.raises(ValueError, match="matching 3-D shapes"):
        generalized_jsd_loss(s, torch.zeros(1, 2, 4), m)
    with pytest.raises(ValueError, match="response_mask shape"):
        generalized_jsd_loss(s, s, torch.ones(2, 2))


def test_response_targets_are_deepspeeds() -> None:
    ds = import_deepspeed("deepspeed.runtime.rollout")
    ds_opsd = import_deepspeed("deepspeed.runtime.rollout.opsd")
    ids = torch.tensor([[0, 3, 4, 7, 5, 0], [6, 3, 4, 8, 9, 1]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    start = torch.tensor([3, 2])
    ours = ResponseTokenBatch.from_rollout(RolloutBatch(ids, mask, start))
    theirs = ds_opsd.ResponseTokenBatch.from_rollout(ds.RolloutBatch(ids, mask, start))
    for name in ("input_ids", "attention_mask", "target_ids", "response_mask"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert ours.response_mask.tolist() == [[False, False, True, True, False], [False, True, True, True, True]]
    logits = torch.randn(2, 6, 9)
    assert torch.equal(ours.select_causal_logits(logits), logits[:, :-1])
    with pytest.raises(ValueError, match=r"must lie in \[1, 6\]"):
        ResponseTokenBatch.from_rollout(RolloutBatch(ids, mask, torch.tensor([0, 2])))
    with pytest.raises(ValueError, match="must be integers"):
        ResponseTokenBatch.from_rollout(RolloutBatch(ids, mask, torch.tensor([3.0, 2.0])))
    with pytest.raises(ValueError, match="do not match input_ids"):
        ours.select_causal_logits(torch.randn(2, 5, 9))


def _drive(module: Any, seed: int) -> list[Any]:
    """A random run of submits, schedules and advances; every transition as plain values."""
    rng = random.Random(seed)
    scheduler = module.ContinuousBatchScheduler(max_batch_size=rng.randint(1, 4), max_new_tokens=rng.randint(1, 5))
    log: list[Any] = []
    next_id = 0
    for _ in range(60):
        action = rng.random()
        if action < 0.3:
            scheduler.submit(module.ContinuousBatchRequest(next_id))
            next_id += 1
            continue
        active = [r.request_id for r in scheduler.active]
        finished = [i for i in active if rng.random() < 0.25]
        update = scheduler.schedule(finished) if action < 0.5 else scheduler.advance(finished)
        log.append(
            (
                update.active_ids,
                update.keep_slots,
                update.retired,
                update.admitted_slots,
                [r.request_id for r in scheduler.pending],
            )
        )
    return log


def test_continuous_batch_scheduler_is_deepspeeds() -> None:
    import zeroshard.runtime.rollout.continuous_batching as ours

    ds = import_deepspeed("deepspeed.runtime.rollout.continuous_batching")
    for seed in range(20):
        assert _drive(ours, seed) == _drive(ds, seed), seed
    scheduler = ContinuousBatchScheduler(1, 2)
    scheduler.submit(ContinuousBatchRequest("a"))
    with pytest.raises(ValueError, match="duplicate request_id: 'a'"):
        scheduler.submit(ContinuousBatchRequest("a"))
    with pytest.raises(TypeError, match="ContinuousBatchRequest"):
        scheduler.submit("b")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not active: 'a'"):
        scheduler.schedule(["a"])
    with pytest.raises(ValueError, match="max_batch_size must be positive"):
        ContinuousBatchScheduler(0, 1)


def test_padding_after_the_first_eos_is_deepspeeds() -> None:
    ds = import_deepspeed("deepspeed.runtime.rollout.hybrid_engine_rollout")
    g = torch.Generator().manual_seed(3)
    for eos, pad in ((EOS, PAD), (EOS, EOS), ([EOS, 6], PAD), (None, PAD)):
        out = torch.randint(0, 8, (6, 9), generator=g)
        ours = HybridEngineRollout._pad_after_eos(out, 3, eos, pad)
        theirs = ds.HybridEngineRollout._pad_after_eos(out, 3, eos, pad)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (eos, pad)


# --- a whole generate against DeepSpeed's -----------------------------------------------------------------------------


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=12,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=1,
    )
    return LlamaForCausalLM(config).eval()


def _request() -> RolloutRequest:
    ids = torch.tensor([[PAD, PAD, 3, 4], [7, 8, 9, 10], [PAD, 2, 6, 11]])
    return RolloutRequest(ids, (ids != PAD).long())


SAMPLINGS = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 1.0, "top_p": 0.9, "n_samples_per_prompt": 2},
    "top_k": {"temperature": 0.8, "top_k": 3, "n_samples_per_prompt": 3},
}


def _rollout(cls: Any, model: Any, seed: int, sampling: Any, **cfg: Any) -> Any:
    tok = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    torch.manual_seed(seed)
    return cls(SimpleNamespace(module=model), tok, cfg=HybridEngineRolloutConfig(**cfg)).generate(_request(), sampling)


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_generate_is_deepspeeds_token_for_token(name: str) -> None:
    ds = import_deepspeed("deepspeed.runtime.rollout")
    model = _model()
    ours = _rollout(HybridEngineRollout, model, 7, SamplingConfig(max_new_tokens=10, **SAMPLINGS[name]))
    theirs = _rollout(ds.HybridEngineRollout, model, 7, ds.SamplingConfig(max_new_tokens=10, **SAMPLINGS[name]))
    for field in ("input_ids", "attention_mask", "response_start_idx"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
    responses = ours.input_ids[:, 4:]
    assert bool((responses == EOS).any()), "the test wants an EOS inside some response"
    assert ours.attention_mask.dtype == torch.long


def test_shared_prefill_decodes_the_same_responses() -> None:
    model = _model()
    for name in ("sampled", "top_k"):
        sampling = SamplingConfig(max_new_tokens=10, **SAMPLINGS[name])
        plain = _rollout(HybridEngineRollout, model, 11, sampling)
        shared = _rollout(HybridEngineRollout, model, 11, sampling, use_shared_prefill=True)
        assert torch.equal(plain.input_ids, shared.input_ids), name
        assert torch.equal(plain.attention_mask, shared.attention_mask), name
    shapes: list[tuple[int, ...]] = []
    handle = model.model.embed_tokens.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    try:
        sampling = SamplingConfig(max_new_tokens=3, **SAMPLINGS["top_k"])
        _rollout(HybridEngineRollout, model, 11, sampling, use_shared_prefill=True)
    finally:
        handle.remove()
    assert shapes == [(3, 4), (9, 1), (9, 1)]  # the prompts once each, then every sample decodes
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_a_tokenizer_without_one_pad_id_is_one_line() -> None:
    tok = SimpleNamespace(pad_token_id=None, eos_token_id=[EOS, 6])
    rollout = HybridEngineRollout(SimpleNamespace(module=_model()), tok)
    with pytest.raises(
        ValueError, match=r"no pad_token_id and its eos_token_id \[5, 6\] .* set tokenizer.pad_token_id"
    ):
        rollout.generate(_request(), SamplingConfig(max_new_tokens=2))


def test_profiling_reports_deepspeeds_keys() -> None:
    ds = import_deepspeed("deepspeed.runtime.rollout")
    model = _model()
    tok = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0)
    ours = HybridEngineRollout(SimpleNamespace(module=model), tok, cfg=HybridEngineRolloutConfig(enable_profiling=True))
    ours.generate(_request(), sampling)
    theirs = ds.HybridEngineRollout(
        SimpleNamespace(module=model), tok, cfg=HybridEngineRolloutConfig(enable_profiling=True)
    )
    theirs.generate(_request(), ds.SamplingConfig(max_new_tokens=6, temperature=0.0))
    profile, reference = ours.get_last_profile(), theirs.get_last_profile()
    assert profile.keys() == reference.keys()
    counts = (
        "num_decode_forwards",
        "num_generated_tokens",
        "batch_size",
        "num_samples_per_prompt",
        "prompt_length",
        "response_length",
    )
    assert (
        {k: profile[k] for k in counts}
        == {k: reference[k] for k in counts}
        == {
            "num_decode_forwards": 5,
            "num_generated_tokens": 18,
            "batch_size": 3,
            "num_samples_per_prompt": 1,
            "prompt_length": 4,
            "response_length": 6,
        }
    )
    assert 0.0 < profile["prefill_forward_ms"] + profile["decode_forward_ms"] <= profile["generation_ms"]
    assert not model._forward_hooks and not model._forward_pre_hooks
