"""Generation under zeroshard's stage 3 where transformers decides `synced_gpus` from its DeepSpeed test ([Note:
generation at stage 3] in generation.py): the Seq2SeqTrainer's `predict_with_generate` with ranks generating
different lengths; and where the engine must not add it (the hybrid engine below stage 3, a generate without it), a
module whose engine is gone, a second engine on the same module."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.hf_trainer import Tokens, arguments, ds_config, tiny_llama


def _tiny_t5() -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=2, decoder_start_token_id=0)
    return T5ForConditionalGeneration(config)


class _Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = Tokens(8, seed=3).ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i][:8]}


def _seq2seq(rank: int, world_size: int, tmp: str) -> tuple[int, int]:
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from zeroshard.hf import TrainerMixin, TrainingArgumentsMixin

    class Args(TrainingArgumentsMixin, Seq2SeqTrainingArguments):
        pass

    class Trainer(TrainerMixin, Seq2SeqTrainer):
        pass

    config = {**ds_config(3), "zeroshard": {"collective_timeout_s": 30}}
    args = Args(**arguments(os.path.join(tmp, "out"), deepspeed=config, predict_with_generate=True))
    trainer = Trainer(model=_tiny_t5(), args=args, train_dataset=_Pairs(), eval_dataset=_Pairs())
    trainer.train()
    predictions = trainer.predict(_Pairs(), max_new_tokens=4 + 3 * rank).predictions  # uneven per rank
    return predictions.shape


def test_seq2seq_predict_with_generate_at_stage_3_finishes_on_every_rank(tmp_path) -> None:
    shapes = run_on_ranks(_seq2seq, 2, str(tmp_path))
    assert len(shapes) == 2 and shapes[0] == shapes[1] and shapes[0][0] == 16, shapes  # 8 pairs twice (predict pads)


class _StrictGenerate(torch.nn.Module):
    """Not a transformers model, though it has a generation config: its generate takes no synced_gpus."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.generation_config = object()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sum()

    def generate(self, x: torch.Tensor, max_new_tokens: int = 1) -> torch.Tensor:
        return self.linear(x)


def _not_added(rank: int, world_size: int) -> dict[str, Any]:
    import gc

    import zeroshard

    out: dict[str, Any] = {}
    prompts = Tokens(8, seed=2).ids[:2, :6]
    # the hybrid engine below stage 3: nothing gathers, so one rank may generate alone (no synced_gpus)
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}
    engine, *_ = zeroshard.initialize(model=tiny_llama(), config={**config, "hybrid_engine": {"enabled": True}})
    if rank == 0:
        out["alone"] = engine.module.generate(input_ids=prompts, max_new_tokens=3, do_sample=False).shape
    engine.destroy()
    # a generate that takes no synced_gpus gets none, at stage 3
    strict = _StrictGenerate()
    engine, *_ = zeroshard.initialize(model=strict, config={**config, "zero_optimization": {"stage": 3}})
    out["strict"] = tuple(engine.module.generate(torch.ones(1, 4)).shape)
    engine.destroy()
    # a second engine over the same module takes generate over; the first one, gone, leaves the module working
    model = tiny_llama()
    first, *_ = zeroshard.initialize(model=model, config={**config, "zero_optimization": {"stage": 3}})
    first.destroy()
    second, *_ = zeroshard.initialize(model=model, config={**config, "zero_optimization": {"stage": 3}})
    del first
    gc.collect()
    out["second"] = model.generate(input_ids=prompts, max_new_tokens=2, do_sample=False).shape
    second.destroy()
    out["restored"] = "generate" not in model.__dict__
    return out


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by stage-3 generation:
# test_seq2seq_predict_with_generate_at_stage_3_finishes_on_every_rank
@pytest.mark.slow
def test_where_the_engine_adds_no_synced_gpus() -> None:
    results = run_on_ranks(_not_added, 2)
    assert tuple(results[0]["alone"]) == (2, 9) and "alone" not in results[1]
    for out in results:
        assert out["strict"] == (1, 4) and tuple(out["second"]) == (2, 8) and out["restored"]
