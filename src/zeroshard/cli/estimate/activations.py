"""Activation memory of a decoder-only transformer per rank, from its shape (an estimate, not a measurement).

Counted per layer and token, in elements kept for backward: the attention block's inputs (norm input,
projection input, q, k, v, attention output) and the MLP's (norm input, projection input, up/gate and
activation outputs), in the compute dtype; the logits in fp32 (Hugging Face losses upcast them) with
their softmax gradient. Attention is assumed fused (SDPA/flash: no s x s scores are kept). With
activation checkpointing only each layer's input is kept, plus one layer recomputed during backward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """What the activation estimate needs from a model config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True  # Llama/Qwen2 SwiGLU (gate, up, act, product) vs GPT-2 (fc, act)

    @property
    def kv_hidden(self) -> int:
        return self.hidden * self.kv_heads // max(self.heads, 1)


def per_layer_elements_per_token(shape: Shape) -> int:
    attention = 4 * shape.hidden + 2 * shape.kv_hidden  # norm in, qkv in, q, attn out + k, v
    mlp = 2 * shape.hidden + (4 if shape.gated_mlp else 2) * shape.intermediate
    return attention + mlp


def activation_bytes(
    shape: Shape, seq_len: int, micro_batch: int, dtype_bytes: int, checkpointing: bool = False
) -> int:
    """Bytes of activations one rank keeps for backward for one micro-batch."""
    tokens = seq_len * micro_batch
    layer = per_layer_elements_per_token(shape) * tokens * dtype_bytes
    logits = tokens * shape.vocab * (dtype_bytes + 4 + 4)  # logits, fp32 copy, its gradient
    if checkpointing:
        return shape.layers * tokens * shape.hidden * dtype_bytes + layer + logits
    return shape.layers * layer + logits
