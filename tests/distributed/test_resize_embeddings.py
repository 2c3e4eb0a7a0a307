"""`resize_token_embeddings` on a model `zero_init` built from a checkpoint: inside a `GatheredParameters(...,
modifier_rank=0)` block (what transformers does under DeepSpeed's ZeRO-3) the old rows keep the checkpoint's values,
the new rows take transformers' mean resizing, every rank holds the same model and it trains; resized on the meta
device (`mean_resizing=False`; the default refuses there in transformers) it is refused before any work in one line
naming the tensor, both shapes and the way that works (it read past the stored tensor: "bad range")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks

pytest.importorskip("transformers")

VOCAB, GROWN = 100, 120


def _resize(rank: int, world_size: int, folder: str, gathered: bool) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    import zeroshard
    from zeroshard.checkpoint.errors import CheckpointError

    torch.manual_seed(5)
    with zeroshard.zero_init():
        model = LlamaForCausalLM.from_pretrained(folder)
    if gathered:
        embeddings = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
        with zeroshard.GatheredParameters(embeddings, modifier_rank=0):
            model.resize_token_embeddings(GROWN)
    else:
        model.resize_token_embeddings(GROWN, mean_resizing=False)
    config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    try:
        engine, *_ = zeroshard.initialize(model=model, config=config)
    except CheckpointError as e:
        return {"refused": str(e)}
    with zeroshard.GatheredParameters([model.get_input_embeddings().weight, model.lm_head.weight]):
        rows = model.get_input_embeddings().weight.detach().clone(), model.lm_head.weight.detach().clone()
    tokens = torch.arange(GROWN - 8, GROWN).view(1, 8)  # the new tokens
    losses = []
    for _ in range(2):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return {"rows": rows, "losses": losses}


@pytest.mark.parametrize(
    "tied", [False, pytest.param(True, marks=pytest.mark.slow)]
)  # CI budget: the default suite in 15 minutes on 2 AVX2 cores
def test_resized_inside_a_block_keeps_the_checkpoint_rows(tmp_path: Path, tied: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    stored = LlamaForCausalLM(config)
    stored.save_pretrained(tmp_path)
    ranks = run_on_ranks(_resize, 2, str(tmp_path), True)
    embedding, head = ranks[0]["rows"]
    assert embedding.shape == (GROWN, 32) and head.shape == (GROWN, 32)
    assert torch.equal(embedding[:VOCAB], stored.get_input_embeddings().weight)
    assert torch.equal(head[:VOCAB], stored.lm_head.weight)
    old = stored.get_input_embeddings().weight
    # transformers' mean resizing: new rows near the old rows' mean (covariance scaled by 1e-9), not zeros or N(0, 1)
    assert torch.allclose(embedding[VOCAB:], old.mean(0).expand(GROWN - VOCAB, -1), atol=1e-3)
    assert embedding[VOCAB:].abs().sum() > 0
    assert torch.equal(head[VOCAB:], embedding[VOCAB:]) == tied
    for name in ("rows", "losses"):
        assert str(ranks[1][name]) == str(ranks[0][name])
    losses = ranks[0]["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]


def test_resized_on_the_meta_device_is_refused_in_one_line(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    for rank in run_on_ranks(_resize, 2, str(tmp_path), False):
        message = rank["refused"]
        assert message.startswith(f"model.embed_tokens.weight is [{GROWN}, 32] but model.embed_tokens.weight in ")
        assert f"is [{VOCAB}, 32]" in message and "GatheredParameters(" in message and "\n" not in message
