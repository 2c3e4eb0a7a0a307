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

[Note: activation estimate of eager attention] A model that runs attention eagerly (transformers' "eager": Gemma-2 by
default, GPT-OSS, whose sinks no fused kernel takes, or `attn_implementation="eager"`) keeps what a fused kernel does
not: each layer's softmax output over the whole seq x seq scores, heads x seq per token, in fp32 (transformers'
softmax runs in fp32; GPT-OSS's in the compute dtype), plus its cast to a narrower compute dtype (what the product
with v saves), plus the tanh of Gemma-2's score softcapping in the compute dtype. A layer's attention backward (after
its MLP's backward let go of what the MLP saved) also holds the probabilities' gradient and the softmax's (fp32).
With checkpointing, the additive seq x seq masks in the compute dtype (one, and one more for sliding-window layers)
stay alive to the end, as every checkpointed layer's input; sliding-window layers compute the whole seq x seq too.
A final logit softcap (Gemma-2) keeps its tanh over the vocabulary in the compute dtype. Norms per layer are counted
in the first decoder layer (Gemma-2/3: four, 3h each; Cohere's parallel block: one). Measured
(tests/unit/test_estimate_activations.py): Llama eager fp32 and bf16, Gemma-2 and GPT-OSS at 128 tokens and at 512
(where the scores dominate, bf16, a sliding window), Gemma-3, with and without checkpointing.
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
    qk_norm: bool = False  # Qwen3's RMSNorm of each head's q and k
    moe: MoeShape | None = None  # mixture-of-experts layers ([Note: activation estimate of experts])
    mla: MlaShape | None = None  # DeepSeek's multi-head latent attention ([Note: activation estimate of MLA])
    eager: EagerShape | None = None  # attention run eagerly ([Note: activation estimate of eager attention])
    norms: int = 2  # norms per layer (Gemma-2/3: 4)
    final_softcap: bool = False  # Gemma-2's tanh over the logits

    @property
    def kv_hidden(self) -> int:
        return self.hidden * self.kv_heads // max(self.heads, 1)


@dataclass(frozen=True)
class EagerShape:
    """[Note: activation estimate of eager attention] what an eager attention layer keeps of its seq x seq scores."""

    softcap: bool = False  # Gemma-2's tanh of the scores
    fp32_softmax: bool = True  # GPT-OSS's softmax runs in the compute dtype
    masks: int = 1  # additive seq x seq masks in the compute dtype (sliding-window layers have their own)

    def bytes_per_score(self, dtype_bytes: int) -> int:
        """Kept per score until the layer's backward: the softmax output (and its cast), the softcap's tanh."""
        kept = 4 + (dtype_bytes if dtype_bytes < 4 else 0) if self.fp32_softmax else dtype_bytes
        return kept + (dtype_bytes if self.softcap else 0)

    def working_bytes_per_score(self, dtype_bytes: int) -> int:
        """Alive per score in the attention's backward: the probabilities' gradient and the softmax's."""
        return 4 + dtype_bytes if self.fp32_softmax else 2 * dtype_bytes


@dataclass(frozen=True)
class MoeShape:
    """[Note: activation estimate of experts] Hugging Face's sparse MoE layers (transformers 5: experts fused, a
    loop over the experts hit) save, per token and chosen expert, the token's input (h), the gate/up projection
    (2 x expert intermediate), the activation and the product (2 x expert intermediate) and the expert's output
    before its routing weight (h): top_k x (2h + 4 I) per token where a dense layer saves 4 I; the router adds its
    probabilities (one per expert) and a shared expert its own 4 I. Measured on Qwen3-MoE shapes
    (tests/unit/test_estimate_activations.py): each term as predicted within a few elements per token."""

    layers: int  # the layers with experts (the others are dense)
    experts: int
    top_k: int
    intermediate: int  # each expert's
    shared_intermediate: int = 0  # a shared expert's (0: none)
    activation: int = 4  # kept per intermediate element by an expert's activation: [Note: GPT-OSS experts]
    last_layer: bool = True  # whether the last layer has experts (its backward is the peak's other moment)


@dataclass(frozen=True)
class MlaShape:
    """[Note: activation estimate of MLA] DeepSeek-V2/V3's attention (transformers 5) saves, per token: the query's
    low-rank projection through its RMSNorm (input, normalized, output: 3 q_lora; none when the query is projected
    directly), the compressed key-value (kv_lora + rope, kept whole by its norm's input view) and its norm's
    normalized value and output (2 kv_lora), the rotated query and key (heads x (nope + rope) each), the key-value
    expansion that the values are a view of (heads x (nope + v)) and the attention output (heads x v). Measured on
    DeepSeek-V3 shapes with a fused attention kernel (v_head_dim = nope + rope on the CPU; with another v_head_dim
    the CPU falls back to the math kernel, which keeps seq x seq scores, as a GPU's kernels do not)."""

    q_lora: int  # 0: the query is projected directly (DeepSeek-V2-Lite)
    kv_lora: int
    rope: int
    nope: int
    v: int

    def elements(self, heads: int) -> int:
        query = 3 * self.q_lora
        key_value = self.kv_lora + self.rope + 2 * self.kv_lora
        return query + key_value + 2 * heads * (self.nope + self.rope) + heads * (self.nope + self.v) + heads * self.v


def per_layer_elements_per_token(shape: Shape, experts: bool = False) -> int:
    """[Note: activation estimate] what one layer saves for backward, per token (`experts`: a MoE layer's)."""
    norms = 3 * shape.norms * shape.hidden
    attention = 2 * shape.hidden + 2 * shape.kv_hidden
    if shape.mla is not None:
        attention = shape.mla.elements(shape.heads)
    elif shape.qk_norm:  # each norm keeps its input and the normalized value
        attention += 2 * (shape.hidden + shape.kv_hidden)
    return norms + attention + mlp_elements_per_token(shape, experts)


def mlp_elements_per_token(shape: Shape, experts: bool = False) -> int:
    """What one layer's MLP (its experts, with `experts`) saves for backward, per token."""
    moe = shape.moe
    if experts and moe is not None:
        mlp = (
            moe.top_k * (2 * shape.hidden + moe.activation * moe.intermediate)
            + moe.experts
            + 4 * moe.shared_intermediate
        )
    else:
        mlp = (4 if shape.gated_mlp else 2) * shape.intermediate
    return mlp


def layer_backward_elements_per_token(shape: Shape, experts: bool = False) -> int:
    """The gradients alive inside one layer's backward, per token (`experts`: a MoE layer's)."""
    moe = shape.moe
    if experts and moe is not None:
        return moe.top_k * (2 * moe.intermediate + shape.hidden) + 2 * moe.shared_intermediate + shape.hidden
    return (2 if shape.gated_mlp else 1) * shape.intermediate + shape.hidden


def loss_bytes_per_token(shape: Shape, dtype_bytes: int) -> int:
    """The fp32 loss: log-softmax output and two logit gradients, and the gradient cast to a narrower dtype."""
    return shape.vocab * (12 + (dtype_bytes if dtype_bytes < 4 else 0) + (dtype_bytes if shape.final_softcap else 0))


def activation_bytes(
    shape: Shape, seq_len: int, micro_batch: int, dtype_bytes: int, checkpointing: bool = False
) -> int:
    """Peak activation bytes of one rank for one micro-batch ([Note: activation estimate])."""
    tokens = seq_len * micro_batch
    moe_layers = shape.moe.layers if shape.moe is not None else 0
    dense, sparse = per_layer_elements_per_token(shape), per_layer_elements_per_token(shape, experts=True)
    # per layer, between its forward and its backward
    kept = shape.layers * shape.hidden if checkpointing else (shape.layers - moe_layers) * dense + moe_layers * sparse
    final_norm = 3 * shape.hidden
    # eager attention's scores, in bytes: every layer's without checkpointing, the recomputed layer's with it
    eager = shape.eager
    scores = shape.heads * seq_len * eager.bytes_per_score(dtype_bytes) if eager is not None else 0
    scores *= 1 if checkpointing else shape.layers
    working = shape.heads * seq_len * eager.working_bytes_per_score(dtype_bytes) if eager is not None else 0
    if eager is not None and checkpointing:  # the masks are every checkpointed layer's input: kept until the end
        kept += eager.masks * seq_len
    at_loss = (
        (kept + final_norm) * dtype_bytes + scores * (not checkpointing) + loss_bytes_per_token(shape, dtype_bytes)
    )
    # the other moment: a layer's backward. Without checkpointing the last layer's (everything is still kept); with
    # it every layer is recomputed in turn, and a layer with experts costs the most wherever it is
    experts = moe_layers > 0 and (checkpointing or shape.moe is not None and shape.moe.last_layer)
    recomputed = (sparse if experts else dense) if checkpointing else 0
    at_mlp = (kept + recomputed + layer_backward_elements_per_token(shape, experts)) * dtype_bytes + scores
    # eager attention's backward comes after the layer's MLP let go of what it saved (and of the norm before it)
    at_attention = (kept + recomputed - mlp_elements_per_token(shape, experts) - 3 * shape.hidden) * dtype_bytes
    at_last_layer = max(at_mlp, at_attention + scores + working) if eager is not None else at_mlp
    return tokens * max(at_loss, at_last_layer)
