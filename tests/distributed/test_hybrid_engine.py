"""`hybrid_engine` ([Note: hybrid engine] in hybrid_engine.py): an RLHF actor's loop (eval, generate through
`engine.module.generate`, train on what it generated) on 2 gloo ranks. Generation with the model gathered once per
call gives the tokens a single-process model with the same weights gives, communicates one gather of the model
(unit by unit it gathers every unit per token), and leaves training bit for bit as an engine without the block."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.hf_trainer import Tokens, tiny_llama

PROMPT, NEW = 6, 4


def _config(stage: int, hybrid: dict[str, Any] | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if hybrid is not None:
        config["hybrid_engine"] = {"enabled": True, **hybrid}
    return config


def _gather_bytes(engine: Any) -> float:
    return engine.comm_stats.kinds["all_gather"].bus_bytes


def _actor_loop(rank: int, world_size: int, stage: int, hybrid: dict[str, Any] | None) -> dict[str, Any]:
    """Two iterations of: weights, eval(), generate, train(), one step on the generated sequences."""
    import zeroshard
    from zeroshard.runtime.hybrid_engine import DeepSpeedHybridEngine

    engine, *_ = zeroshard.initialize(model=tiny_llama(), config=_config(stage, hybrid))
    assert isinstance(engine, DeepSpeedHybridEngine) == (hybrid is not None)
    prompts = Tokens(8, seed=2).ids[2 * rank : 2 * rank + 2, :PROMPT]
    out: dict[str, Any] = {"weights": [], "generated": [], "losses": [], "generate_bytes": []}
    for _ in range(2):
        weights = {k: v.clone() for k, v in engine.module_state_dict().items()}  # stage 3 gathers: every rank
        out["weights"].append(weights if rank == 0 else None)
        engine.eval()
        before = _gather_bytes(engine)
        # DeepSpeed-Chat's call (ppo_trainer._generate_sequence): positional prompts, a mask, max_length
        mask = torch.ones_like(prompts)
        seq = engine.module.generate(
            prompts, attention_mask=mask, max_length=PROMPT + NEW, pad_token_id=0, do_sample=False, synced_gpus=True
        )
        out["generate_bytes"].append(_gather_bytes(engine) - before)
        engine.train()
        loss = engine(input_ids=seq, labels=seq).loss
        engine.backward(loss)
        engine.step()
        out["generated"].append(seq)
        out["losses"].append(loss.item())
    out["final"] = engine.module_state_dict()
    out["model_bytes"] = sum(p.numel() * 4 for p in tiny_llama().parameters())
    engine.destroy()
    out["generate_restored"] = "generate" not in engine.module.__dict__
    return out


def _loops(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "pinned": _actor_loop(rank, world_size, 3, {}),
        "unpinned": _actor_loop(rank, world_size, 3, {"pin_parameters": False}),
        "plain": _actor_loop(rank, world_size, 3, None),
        "stage2": _actor_loop(rank, world_size, 2, {}),
    }


def _reference_generate(weights: dict[str, torch.Tensor], prompts: torch.Tensor) -> torch.Tensor:
    model = tiny_llama()
    model.load_state_dict(weights)
    return model.eval().generate(input_ids=prompts, max_new_tokens=NEW, do_sample=False)


def test_an_actor_loop_generates_as_the_model_and_trains_as_without_the_block() -> None:
    results = run_on_ranks(_loops, 2)
    for rank, per_rank in enumerate(results):
        prompts = Tokens(8, seed=2).ids[2 * rank : 2 * rank + 2, :PROMPT]
        pinned, unpinned, plain = per_rank["pinned"], per_rank["unpinned"], per_rank["plain"]
        for name, run in per_rank.items():
            for weights, seq in zip(results[0][name]["weights"], run["generated"], strict=True):
                assert torch.equal(seq, _reference_generate(weights, prompts)), name
            assert run["generate_restored"], name
        # training is the plain engine's, bit for bit, with and without pinning
        for run in (pinned, unpinned):
            assert run["losses"] == plain["losses"]
            assert all(torch.equal(run["final"][k], v) for k, v in plain["final"].items())
        # one gather of the model per generate call (2 ranks: half of it comes from the other rank), against every
        # unit for each of the NEW forwards unit by unit
        model_bytes = pinned["model_bytes"]
        for pinned_bytes, unpinned_bytes in zip(pinned["generate_bytes"], unpinned["generate_bytes"], strict=True):
            assert 0 < pinned_bytes <= model_bytes * 1.01, (pinned_bytes, model_bytes)
            assert unpinned_bytes >= NEW * pinned_bytes, (unpinned_bytes, pinned_bytes)
        assert per_rank["stage2"]["generate_bytes"] == [0, 0]


def _settings(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    import zeroshard
    from zeroshard.accelerator import get_accelerator

    out: dict[str, Any] = {}
    # every rank takes rank 0's RNG state at initialize (as DeepSpeed), only with the block
    for hybrid in (None, {}):
        model = tiny_llama()  # seeds the generator itself
        torch.manual_seed(100 + rank)
        engine, *_ = zeroshard.initialize(model=model, config=_config(3, hybrid))
        out[f"draw_{hybrid is not None}"] = torch.rand(4)
        engine.destroy()
    config = _config(3, {"release_inference_cache": True})
    engine, *_ = zeroshard.initialize(model=tiny_llama(), config=config)
    prompts = Tokens(8, seed=2).ids[:2, :PROMPT]
    # release_inference_cache: the device's cache emptied after each call
    emptied = []
    accelerator = get_accelerator()
    original = accelerator.empty_cache
    accelerator.empty_cache = lambda: emptied.append(True)  # type: ignore[method-assign]
    try:
        engine.generate(input_ids=prompts, max_new_tokens=NEW - 1, do_sample=False)
    finally:
        accelerator.empty_cache = original  # type: ignore[method-assign]
    out["emptied"] = len(emptied)
    # eval() logs DeepSpeed's latency line from the second call on (rank 0)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    hybrid_logger = logging.getLogger("zeroshard.hybrid_engine")
    hybrid_logger.addHandler(handler)
    hybrid_logger.setLevel(logging.INFO)
    engine.eval()
    engine.generate(input_ids=prompts, max_new_tokens=NEW - 1, do_sample=False)
    engine.train()
    engine.eval()
    hybrid_logger.removeHandler(handler)
    out["lines"] = records
    engine.destroy()
    return out


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by the actor loop:
# test_an_actor_loop_generates_as_the_model_and_trains_as_without_the_block
@pytest.mark.slow
def test_rng_release_and_the_latency_line(tmp_path) -> None:
    results = run_on_ranks(_settings, 2, str(tmp_path))
    assert torch.equal(results[0]["draw_True"], results[1]["draw_True"])
    assert not torch.equal(results[0]["draw_False"], results[1]["draw_False"])
    for rank, out in enumerate(results):
        assert out["emptied"] == 1
        assert len(out["lines"]) == (1 if rank == 0 else 0), out["lines"]
    line = results[0]["lines"][0]
    assert line.startswith("|E2E latency=") and "|Generate time=" in line and "|CurSamplesPerSec=" in line, line


def _uneven(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks generate different numbers of tokens without synced_gpus (the model is gathered: nothing to wait for),
    then train: no divergence is reported and the training step's prefetch trace survives generation."""
    import copy

    import zeroshard

    config = _config(3, {})
    config["zero_optimization"]["log_trace_cache_warnings"] = True
    engine, *_ = zeroshard.initialize(model=tiny_llama(), config=config)
    prompts = Tokens(8, seed=2).ids[2 * rank : 2 * rank + 2, :PROMPT]
    trace = engine.strategy.schedule.trace
    losses, recorded = [], []
    for _ in range(3):
        engine.eval()
        seq = engine.module.generate(input_ids=prompts, max_new_tokens=NEW + 3 * rank, do_sample=False)
        engine.train()
        loss = engine(input_ids=seq[:, : PROMPT + NEW], labels=seq[:, : PROMPT + NEW]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        recorded.append(list(engine.strategy.schedule.trace.recorded or []))
    # a copy of the module generates with its own weights, through its class's generate; a pickle reduces to the same
    # (a stage-3 module itself does not pickle: its hooks are closures)
    twin = copy.deepcopy(engine.module)
    kinds = (type(twin.__dict__["generate"]).__name__, engine.module.generate.__reduce__()[0].__name__)
    bound_to_copy = twin.generate.__self__ is twin
    same_trace = trace is engine.strategy.schedule.trace
    engine.destroy()
    return {
        "losses": losses,
        "recorded": recorded,
        "same_trace": same_trace,
        "kinds": kinds,
        "bound_to_copy": bound_to_copy,
        "lengths": seq.shape[1],
    }


def _gathered_parameters_generation(rank: int, world_size: int) -> list[Any]:
    """DeepSpeed's and TRL's idiom without the hybrid engine: generate inside GatheredParameters over every
    parameter, each rank its own number of tokens ([Note: forwards of the whole gathered model]); then train on the
    same sequences as a run that generated nothing in between."""
    import zeroshard

    prompts = Tokens(8, seed=2).ids[2 * rank : 2 * rank + 2, :PROMPT]
    sequences = [prompts.repeat(1, 2)[:, : PROMPT + NEW], prompts.flip(1).repeat(1, 2)[:, : PROMPT + NEW]]
    out = []
    for generate in (False, True):
        engine, *_ = zeroshard.initialize(model=tiny_llama(), config=_config(3, None))
        losses, traces = [], []
        for seq in sequences:
            if generate:
                with zeroshard.GatheredParameters(list(engine.module.parameters())), torch.no_grad():
                    engine.module.generate(input_ids=prompts, max_new_tokens=NEW + 3 * rank, do_sample=False)
            loss = engine(input_ids=seq, labels=seq).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            traces.append(list(engine.strategy.schedule.trace.recorded or []))
        engine.destroy()
        out.append((losses, traces))
    return out


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by the actor loop:
# test_an_actor_loop_generates_as_the_model_and_trains_as_without_the_block
@pytest.mark.slow
def test_generation_inside_gathered_parameters_leaves_training_alone() -> None:
    for (plain_losses, plain_traces), (losses, traces) in run_on_ranks(_gathered_parameters_generation, 2):
        assert losses == plain_losses and traces == plain_traces  # no divergence reported, the same training


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by uneven generation:
# test_stage_3_generation_of_different_lengths_finishes_on_every_rank
@pytest.mark.slow
def test_uneven_generation_then_training_and_copies_of_the_module() -> None:
    results = run_on_ranks(_uneven, 2)
    assert [r["lengths"] for r in results] == [PROMPT + NEW, PROMPT + NEW + 3]
    for out in results:
        # the order training recorded stays: generation's forwards do not replace it
        assert (
            out["same_trace"] and out["recorded"][0] and out["recorded"][1] == out["recorded"][0] == out["recorded"][2]
        )
        assert out["kinds"] == ("method", "method") and out["bound_to_copy"]


def _plain_uneven(rank: int, world_size: int) -> dict[str, Any]:
    """Without the hybrid engine, stage 3 gathering unit by unit: ranks asking for different numbers of tokens finish
    together ([Note: generation at stage 3]: synced_gpus by default, as transformers sets it under DeepSpeed)."""
    import zeroshard

    engine, *_ = zeroshard.initialize(model=tiny_llama(), config=_config(3, None))
    weights = {k: v.clone() for k, v in engine.module_state_dict().items()}
    prompts = Tokens(8, seed=2).ids[2 * rank : 2 * rank + 2, :PROMPT]
    engine.eval()
    seq = engine.module.generate(input_ids=prompts, max_new_tokens=NEW + 3 * rank, do_sample=False)
    engine.destroy()
    return {"seq": seq, "weights": weights if rank == 0 else None, "restored": "generate" not in engine.module.__dict__}


def test_stage_3_generation_of_different_lengths_finishes_on_every_rank() -> None:
    results = run_on_ranks(_plain_uneven, 2)
    for rank, out in enumerate(results):
        prompts = Tokens(8, seed=2).ids[2 * rank : 2 * rank + 2, :PROMPT]
        model = tiny_llama()
        model.load_state_dict(results[0]["weights"])
        expected = model.eval().generate(input_ids=prompts, max_new_tokens=NEW + 3 * rank, do_sample=False)
        assert torch.equal(out["seq"], expected) and out["restored"], rank
