"""Hugging Face mixture-of-experts models (Qwen3-MoE, Mixtral, DeepSeek-V3: experts fused in transformers 5,
stored apart in their checkpoints) on 2 ranks: streamed under `zero_init` from a checkpoint in several files, every
tensor equals transformers' own `from_pretrained` ([Note: converted checkpoints in a streaming load]) at stage 3,
stage 2 and on the fsdp2 backend, and trains bit for bit as the model loaded whole; the models train at stages 2
and 3 as a single process does (the router's auxiliary loss included)."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.hf_moe import KINDS, save_moe, tiny_moe, token_batches

pytest.importorskip("transformers")

REL = 1e-6


def _config(stage: int, backend: str = "zero") -> dict[str, Any]:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    optimizer = {"type": "AdamW", "params": {"lr": 1e-3}}
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": optimizer, "zero_optimization": zero,
            "zeroshard": {"backend": backend}}  # fmt: skip


def _train(engine: Any, rank: int, world_size: int) -> list[float]:
    losses = []
    for ids in token_batches(world_size):
        mine = ids.chunk(world_size)[rank]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def _streamed(rank: int, world_size: int, folder: str, stage: int, backend: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    import zeroshard

    torch.set_num_threads(1)
    with zeroshard.zero_init():
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    engine, *_ = zeroshard.initialize(model=model, config=_config(stage, backend))
    weights = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    out = {"info": info, "weights": weights if rank == 0 else None, "losses": _train(engine, rank, world_size)}
    engine.destroy()
    whole = AutoModelForCausalLM.from_pretrained(folder)  # transformers fuses the experts itself
    engine, *_ = zeroshard.initialize(model=whole, config=_config(stage, backend))
    out["whole_losses"] = _train(engine, rank, world_size)
    engine.destroy()
    return out


CASES = [
    ("qwen3_moe", 3, "zero"),
    ("mixtral", 3, "zero"),
    ("deepseek_v3", 3, "zero"),
    ("mixtral", 2, "zero"),
    ("qwen3_moe", 3, "fsdp2"),
]


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores): all but Mixtral at stage 3
@pytest.mark.parametrize(
    ("kind", "stage", "backend"),
    [pytest.param(*c, marks=pytest.mark.slow if c != ("mixtral", 3, "zero") else ()) for c in CASES],
    ids=[f"{k}-stage{s}-{b}" for k, s, b in CASES],
)
def test_moe_checkpoint_streams_into_shards_as_transformers_loads_it(tmp_path, kind, stage, backend):
    from transformers import AutoModelForCausalLM

    folder = str(tmp_path / kind)
    save_moe(kind, folder)
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 1
    expected = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    ranks = run_on_ranks(_streamed, 2, folder, stage, backend)
    assert not any(ranks[0]["info"][k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    weights = ranks[0]["weights"]
    assert sorted(weights) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name
    for out in ranks:
        assert out["losses"] == out["whole_losses"]


def _parity(rank: int, world_size: int, kind: str, stage: int) -> list[float]:
    import zeroshard

    torch.set_num_threads(1)
    engine, *_ = zeroshard.initialize(model=tiny_moe(kind), config=_config(stage))
    losses = _train(engine, rank, world_size)
    engine.destroy()
    return losses


def _reference(kind: str, world_size: int) -> list[float]:
    """One process, the whole global batch: each rank's micro-batch loss averaged, DeepSpeed's clipping (1.0)
    and its AdamW (fused, weight_decay 0)."""
    torch.set_num_threads(1)
    model = tiny_moe(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    losses = []
    for ids in token_batches(world_size):
        optimizer.zero_grad()
        total = 0.0
        for part in ids.chunk(world_size):
            loss = model(input_ids=part, labels=part).loss / world_size
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(total)
    return losses


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "stage", [2, pytest.param(3, marks=pytest.mark.slow)]
)  # CI budget: the default suite in 15 minutes on 2 AVX2 cores
def test_moe_models_train_as_a_single_process(kind, stage):
    reference = _reference(kind, 2)
    for losses in run_on_ranks(_parity, 2, kind, stage):
        for step, (a, b) in enumerate(zip(reference, losses, strict=True)):
            assert math.isclose(a, b, rel_tol=REL), (step, reference, losses)


def _trainer(rank: int, world_size: int, folder: str, out: str) -> dict[str, torch.Tensor] | None:
    from transformers import AutoModelForCausalLM

    import zeroshard
    from helpers.hf_trainer import Tokens, arguments
    from zeroshard.hf import Trainer, TrainingArguments

    with zeroshard.zero_init():
        model = AutoModelForCausalLM.from_pretrained(folder)
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    config = {"zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    data = Tokens(16)
    data.ids = data.ids % 64  # the tiny models' vocabulary
    trainer = Trainer(
        model=model, args=TrainingArguments(**arguments(out, deepspeed=config, max_steps=2)), train_dataset=data
    )
    trainer.train()
    trainer.save_model(os.path.join(out, "final"))
    weights = {k: v.clone() for k, v in trainer.engine.consolidated_state_dict().items()}
    trainer.engine.destroy()
    return weights if rank == 0 else None


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by streamed MoE checkpoints:
# test_moe_checkpoint_streams_into_shards_as_transformers_loads_it
@pytest.mark.slow
def test_the_trainer_fine_tunes_a_streamed_moe_and_saves_it_in_transformers_format(tmp_path):
    """As ms-swift runs a MoE fine-tune at ZeRO-3: streamed in, trained, saved; transformers writes the experts apart
    again and loads them back equal to the engine's."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    folder, out = str(tmp_path / "qwen3"), str(tmp_path / "run")
    save_moe("qwen3_moe", folder)
    trained = run_on_ranks(_trainer, 2, folder, out)[0]
    final = os.path.join(out, "final")
    with safe_open(os.path.join(final, "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in set(f.keys())
    loaded = AutoModelForCausalLM.from_pretrained(final).state_dict()
    original = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert sorted(loaded) == sorted(trained)
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
    assert not torch.equal(
        loaded["model.layers.0.mlp.experts.gate_up_proj"], original["model.layers.0.mlp.experts.gate_up_proj"]
    )


def _submodule(rank: int, world_size: int, folder: str) -> dict[str, Any] | None:
    from transformers import AutoModelForCausalLM

    import zeroshard

    with zeroshard.zero_init():
        full = AutoModelForCausalLM.from_pretrained(folder)
    engine, *_ = zeroshard.initialize(model=full.model, config=_config(3))  # the checkpoint is full's
    weights = engine.consolidated_state_dict(torch.float32, rank == 0, torch.device("cpu"))
    engine.destroy()
    return weights if rank == 0 else None


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by streamed MoE checkpoints:
# test_moe_checkpoint_streams_into_shards_as_transformers_loads_it
@pytest.mark.slow
def test_a_submodule_of_a_streamed_model_reads_the_checkpoint(tmp_path) -> None:
    """`initialize(model=full.model)` for a model from_pretrained built under zero_init: its parameters come from the
    checkpoint (the checkpoint was looked up on the module passed and its children only, so every parameter kept
    its random initialisation, silently)."""
    save_moe("mixtral", str(tmp_path))
    got = run_on_ranks(_submodule, 2, str(tmp_path), timeout=300)[0]
    want = tiny_moe("mixtral").model.state_dict()
    assert got is not None and set(got) == set(want)
    assert [k for k, v in want.items() if not torch.equal(got[k], v)] == []
