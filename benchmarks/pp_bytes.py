"""Bytes per step, per scope and kind, of pipeline parallelism composed with ZeRO-1 against pure ZeRO-3.

    python -m benchmarks.pp_bytes [--out FILE]   (the table of docs/benchmarks_pipeline.md)

4 gloo ranks acting as 2 nodes x 2 (ZEROSHARD_RANKS_PER_NODE=2, [Note: nodes]) train the tensor-parallel tests'
Llama-shaped model (tests/helpers/tp_parity.py: hidden 64, 2 layers, vocabulary 128), the same weights and the same
global batch (8 sequences of 16 tokens) per step, and count what one step sends (benchmarks/scope_bytes.py):
- `pp2 x dp2, ZeRO-1`: a PipelineModule of the model's own modules (embedding, decoder layers, norm, head) in 2
  stages, 1F1B over 2 micro-batches of 2 sequences. [Note: pipeline mesh] puts a stage on consecutive ranks, so
  with 2 ranks per node each stage is one node and its ZeRO-1 group stays inside it, while the activations and their
  gradients cross nodes (ranks 0 <-> 2, 1 <-> 3). The stages hold different layers, so both are shown (ranks 0, 2);
- `dp4, ZeRO-3` (pure ZeRO-3) and `dp4, ZeRO-1` (the same ZeRO stage without the pipeline), one micro-batch of 2
  sequences per rank.
ZeRO-2 and ZeRO-3 with a pipeline are refused, as DeepSpeed refuses them (pipe/context.py, [Note: pipeline config]).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.scope_bytes import Result, cli, init_nodes, measure_steps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

STAGES, MICRO, GAS = 2, 2, 2  # pp2 x dp2: 2 replicas x 2 micro-batches x 2 sequences = dp4's 4 x 2
LOSS_RTOL = 1e-5  # the pipeline's first loss against pure ZeRO-3's: the same model and batch


class DecoderBlock(nn.Module):
    """One Hugging Face Llama decoder layer as a pipeline layer: hidden states in and out (the one tensor that
    travels between stages), with the rotary embeddings and causal mask LlamaModel would hand it made here."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        seq = hidden.shape[1]
        positions = torch.arange(seq, device=hidden.device)[None]
        mask = torch.full((seq, seq), torch.finfo(hidden.dtype).min, device=hidden.device).triu(1)[None, None]
        out: torch.Tensor = self.layer(
            hidden, attention_mask=mask, position_ids=positions, position_embeddings=self.rotary(hidden, positions)
        )
        return out


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """LlamaForCausalLM's loss: each position predicts the next token."""
    vocab = logits.shape[-1]
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1))


def pipeline_layers(model: Any) -> list[nn.Module]:
    """A LlamaForCausalLM's own modules as a layer list: embedding, decoder blocks, norm, head."""
    inner = model.model
    blocks = [DecoderBlock(layer, inner.rotary_emb) for layer in inner.layers]
    return [inner.embed_tokens, *blocks, inner.norm, model.lm_head]


def pp_config() -> dict[str, Any]:
    from helpers.tp_parity import TpCase, config

    cfg = config(TpCase(stage=1), tp=1)
    del cfg["tensor_parallel"]
    cfg.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=GAS)
    cfg["pipeline"] = {"stages": STAGES, "schedule": "1f1b"}
    return cfg


def measure(rank: int, world_size: int) -> Result:
    """The pipeline variant named by this rank's stage, then the dp4 references (scope_bytes.measure_steps)."""
    scope_of = init_nodes(world_size)
    import zeroshard
    from helpers.tp_parity import TpCase, config, llama
    from zeroshard.pipe import PipelineModule

    net = PipelineModule(layers=pipeline_layers(llama()), num_stages=STAGES, loss_fn=causal_lm_loss)
    engine, _, _, _ = zeroshard.initialize(model=net, config=pp_config())
    stage, losses = net.stage_id, list[float]()
    name = f"pp2 x dp2, ZeRO-1: stage {stage} (layers {net.parts[stage]}-{net.parts[stage + 1] - 1}, rank {rank})"
    out = {name: measure_steps(engine, functools.partial(_pp_step, engine, losses), scope_of)}
    engine.destroy()
    for label, zero in (("dp4, ZeRO-3", 3), ("dp4, ZeRO-1", 1)):
        model = llama()
        cfg = config(TpCase(stage=zero), tp=1)
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        reference: list[float] = []
        out[label] = measure_steps(engine, functools.partial(_dp_step, engine, rank, reference), scope_of)
        engine.destroy()
    _check_same_loss(losses[0], reference[0])
    return out


def _pp_step(engine: Any, losses: list[float], i: int) -> None:
    """Replica q's micro-batches are dp4's replicas 2q and 2q + 1: the same global batch."""
    from helpers.tp_parity import batch

    replica = engine.pipe.groups.replica
    micro = [batch(i, GAS * replica + m) for m in range(GAS)]
    losses.append(float(engine.train_batch(data_iter=iter([(ids, ids) for ids in micro]))))


def _dp_step(engine: Any, rank: int, losses: list[float], i: int) -> None:
    import torch.distributed as dist

    from helpers.tp_parity import batch

    ids = batch(i, rank)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # outside the measured engine's counters, and not a P2P: counted by neither
    losses.append(float(mean) / dist.get_world_size())


def _check_same_loss(pipeline: float, data_parallel: float) -> None:
    """The pipeline trains the model the dp4 rows train (same weights, same batch), or the comparison is void."""
    if abs(pipeline - data_parallel) > LOSS_RTOL * abs(data_parallel):
        raise AssertionError(f"pipeline loss {pipeline} != data-parallel loss {data_parallel} on the first batch")


if __name__ == "__main__":
    cli(__doc__.splitlines()[0], measure, ranks=(0, 2))
