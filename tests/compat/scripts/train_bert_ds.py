"""Masked-language-model pre-training of a small RoBERTa, with save and resume, through the DeepSpeed API.

Re-created (trimmed, rewritten) from DeepSpeedExamples `training/HelloDeepSpeed/train_bert_ds.py`,
commit 45b4b7156c8794a3452a5a7d03dbd8d797068569. Kept as upstream: `get_accelerator().device_name()/is_available()`,
the ds_config (train_micro_batch_size_per_gpu, "Adam", bf16, ZeRO stage 1 with `offload_optimizer` to the CPU),
`initialize(model=, model_parameters=, config=)`, `backward`/`step`, `save_checkpoint(save_dir=, client_state=)` and
`load_checkpoint(load_dir=)` returning the client state. Changed: synthetic token batches instead of
wikitext + tokenizer, argparse instead of `fire`, a 512-token vocabulary, dropout 0, `torch_adam: true` so that
DeepSpeed does not JIT-build its CPU Adam; the script trains, saves, then resumes in a second engine.
The library is a switch: COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard.
"""

import argparse
import importlib
import json
import os
import pathlib
import random
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn as nn
from transformers.models.roberta.modeling_roberta import (
    RobertaConfig,
    RobertaLMHead,
    RobertaModel,
    RobertaPreTrainedModel,
)

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))
get_accelerator = importlib.import_module(f"{deepspeed.__name__}.accelerator").get_accelerator

VOCAB = 512
PAD = 1
MASK = 4


def is_rank_0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def create_data_iterator(batch_size: int, max_seq_length: int, mask_prob: float) -> Iterator[dict[str, torch.Tensor]]:
    """Endless synthetic MLM batches: random tokens, `mask_prob` of them masked, targets padded elsewhere."""
    generator = torch.Generator().manual_seed(7)
    while True:
        tokens = torch.randint(5, VOCAB, (batch_size, max_seq_length), generator=generator)
        masked = torch.rand(batch_size, max_seq_length, generator=generator) < mask_prob
        masked[:, 0] = True  # at least one target per row
        yield {
            "src_tokens": torch.where(masked, torch.full_like(tokens, MASK), tokens),
            "attention_mask": torch.ones_like(tokens),
            "tgt_tokens": torch.where(masked, tokens, torch.full_like(tokens, PAD)),
        }


class RobertaLMHeadWithMaskedPredict(RobertaLMHead):
    def __init__(self, config: RobertaConfig, embedding_weight: torch.Tensor | None = None) -> None:
        super().__init__(config)
        if embedding_weight is not None:
            self.decoder.weight = embedding_weight

    def forward(self, features: torch.Tensor, masked_token_indices: torch.Tensor | None = None, **kwargs):
        if masked_token_indices is not None:
            features = torch.index_select(features.view(-1, features.shape[-1]), 0, masked_token_indices)
        return super().forward(features)


class RobertaMLMModel(RobertaPreTrainedModel):
    def __init__(self, config: RobertaConfig, encoder: RobertaModel) -> None:
        super().__init__(config)
        self.encoder = encoder
        self.lm_head = RobertaLMHeadWithMaskedPredict(config, self.encoder.embeddings.word_embeddings.weight)
        self.lm_head.apply(self._init_weights)

    def forward(self, src_tokens: torch.Tensor, attention_mask: torch.Tensor, tgt_tokens: torch.Tensor):
        sequence_output, *_ = self.encoder(input_ids=src_tokens, attention_mask=attention_mask, return_dict=False)
        masked_token_indexes = torch.nonzero((tgt_tokens != self.config.pad_token_id).view(-1)).view(-1)
        prediction_scores = self.lm_head(sequence_output, masked_token_indexes)
        target = torch.index_select(tgt_tokens.view(-1), 0, masked_token_indexes)
        loss_fct = nn.CrossEntropyLoss(ignore_index=-1)
        return loss_fct(prediction_scores.view(-1, self.config.vocab_size), target)


def create_model(num_layers: int, num_heads: int, ff_dim: int, h_dim: int, dropout: float) -> RobertaMLMModel:
    roberta_config = RobertaConfig.from_dict(
        {
            "attention_probs_dropout_prob": dropout,
            "bos_token_id": 0,
            "eos_token_id": 2,
            "hidden_act": "gelu",
            "hidden_dropout_prob": dropout,
            "hidden_size": h_dim,
            "initializer_range": 0.02,
            "intermediate_size": ff_dim,
            "layer_norm_eps": 1e-05,
            "max_position_embeddings": 64,
            "model_type": "roberta",
            "num_attention_heads": num_heads,
            "num_hidden_layers": num_layers,
            "pad_token_id": PAD,
            "type_vocab_size": 1,
            "vocab_size": VOCAB,
        }
    )
    return RobertaMLMModel(roberta_config, RobertaModel(roberta_config))


def train(
    checkpoint_dir: str | None = None,
    load_checkpoint_dir: str | None = None,
    num_iterations: int = 4,
    checkpoint_every: int = 2,
    batch_size: int = 4,
    max_seq_length: int = 16,
    dtype: str = "bf16",
    local_rank: int = -1,
) -> list[float]:
    device = (
        torch.device(get_accelerator().device_name(), local_rank)
        if (local_rank > -1) and get_accelerator().is_available()
        else torch.device("cpu")
    )
    exp_dir = pathlib.Path(checkpoint_dir or load_checkpoint_dir)
    exp_dir.mkdir(exist_ok=True)
    torch.manual_seed(42)
    data_iterator = create_data_iterator(batch_size, max_seq_length, mask_prob=0.15)
    model = create_model(num_layers=2, num_heads=2, ff_dim=64, h_dim=32, dropout=0.0)

    assert dtype == "fp16" or dtype == "bf16"
    ds_config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        dtype: {"enabled": True},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    start_step = 1
    if load_checkpoint_dir is not None:
        _, client_state = model.load_checkpoint(load_dir=load_checkpoint_dir)
        checkpoint_step = client_state["checkpoint_step"]
        start_step = checkpoint_step + 1
        # the data stream resumes where the saved run stopped
        for _ in range(checkpoint_step):
            next(data_iterator)

    model.train()
    losses = []
    step = start_step
    for step, batch in enumerate(data_iterator, start=start_step):
        if step >= num_iterations:
            break
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if step % checkpoint_every == 0:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    if step % checkpoint_every != 0:
        model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="HelloDeepSpeed MLM")
    parser.add_argument("--checkpoint_dir", required=True)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    # upstream's `fire` takes train()'s local_rank, which the deepspeed launcher passes as --local_rank=N
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "-1")))
    args = parser.parse_args()
    torch.manual_seed(42)
    np.random.seed(0)
    random.seed(0)
    local_rank = args.local_rank
    first = train(checkpoint_dir=args.checkpoint_dir, num_iterations=4, dtype=args.dtype, local_rank=local_rank)
    resumed = train(load_checkpoint_dir=args.checkpoint_dir, num_iterations=7, dtype=args.dtype, local_rank=local_rank)
    if is_rank_0():
        print("COMPAT_RESULT " + json.dumps({"losses": first + resumed}), flush=True)
