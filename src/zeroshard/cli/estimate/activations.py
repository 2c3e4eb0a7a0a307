"""Activation memory of a decoder-only transformer per rank, from its shape (an estimate, checked against
measurements in tests/unit/test_estimate_activations.py).

[Note: activation estimate] The number is the peak of activation bytes during one micro-batch's forward and
backward, on top of the model states. Elements kept per layer and token, as Hugging Face's Llama/Qwen2/Mistral
layers save them for backward (attention through SDPA/flash, so no seq x seq scores are kept):
- two RMSNorms, each: its input, the normalized value and the scaled output (the next projection's input): 6h;
- attention: q and k after the rotary embedding, v, the attention output: 2h + 2 kv_hidden;
- gated MLP: gate and up projections, the activation and the product: 4 x intermediate (GPT-2 style: 2).
Outside the layers: the final norm (3h), and the loss in fp32 whatever the compute dtype (Hugging Face upcasts
the logits): log-softmax output and two gradients of the logits, 12 bytes per vocabulary entry, plus the
gradient cast back when the compute dtype is narrower. The peak is the larger of two moments: the loss's backward
(everything saved, plus the loss's gradients) and the last layer's backward (its saved values, plus its working
gradients: 2 x intermediate + h). With activation checkpointing each layer keeps only its input (h) and one layer
is recomputed at a time.
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
    """[Note: activation estimate] what one layer saves for backward, per token."""
    norms = 6 * shape.hidden
    attention = 2 * shape.hidden + 2 * shape.kv_hidden
    mlp = (4 if shape.gated_mlp else 2) * shape.intermediate
    return norms + attention + mlp


def layer_backward_elements_per_token(shape: Shape) -> int:
    """The gradients alive inside one layer's backward, per token."""
    return (2 if shape.gated_mlp else 1) * shape.intermediate + shape.hidden


def loss_bytes_per_token(shape: Shape, dtype_bytes: int) -> int:
    """The fp32 loss: log-softmax output and two logit gradients, and the gradient cast to a narrower dtype."""
    return shape.vocab * (12 + (dtype_bytes if dtype_bytes < 4 else 0))


def activation_bytes(
    shape: Shape, seq_len: int, micro_batch: int, dtype_bytes: int, checkpointing: bool = False
) -> int:
    """Peak activation bytes of one rank for one micro-batch ([Note: activation estimate])."""
    tokens = seq_len * micro_batch
    layer = per_layer_elements_per_token(shape)
    kept = shape.hidden if checkpointing else layer  # per layer, between its forward and its backward
    final_norm = 3 * shape.hidden
    at_loss = (shape.layers * kept + final_norm) * dtype_bytes + loss_bytes_per_token(shape, dtype_bytes)
    recomputed = layer if checkpointing else 0
    at_last_layer = (shape.layers * kept + recomputed + layer_backward_elements_per_token(shape)) * dtype_bytes
    return tokens * max(at_loss, at_last_layer)
