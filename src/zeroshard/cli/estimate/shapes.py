"""What `estimate` knows about a model: parameter count, largest layer, and a shape for activations.

From a Hugging Face folder or a built-in config name the model is built on the meta device (no
memory, no download) and counted exactly, tied weights once, as DeepSpeed's `model_to_params` does.
From a bare parameter count a Llama-like shape is assumed (hidden/layers = 128, 32k vocabulary).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from zeroshard.cli.estimate.activations import EagerShape, MlaShape, MoeShape, Shape
from zeroshard.errors import ConfigError


@dataclass(frozen=True)
class ModelInfo:
    name: str
    params: int  # unique parameters (tied weights counted once)
    largest_layer: int  # parameters of the largest module, counting only its own (DeepSpeed's definition)
    shape: Shape
    assumed: str | None = None  # how the shape was guessed, when it was
    # parameters Muon orthogonalises (2+ dims, not an embedding or head: `optim.muon.uses_muon`); the rest take Adam
    matrices: int = 0
    # routed experts held fused (transformers 5's experts modules): what `expert_parallel` splits ([Note: AutoEP])
    experts: int = 0
    num_experts: int = 0
    largest_experts: int = 0  # the largest fused experts module's own parameters (a stage-3 unit of its own)
    largest_dense: int = 0  # the largest module's own parameters, the fused experts modules left out

    def largest_unit(self, autoep: int = 1) -> int:
        """The largest stage-3 gathered unit's parameters: with `autoep` > 1 an experts module holds its 1/autoep
        of the experts ([Note: experts at stage 3]), so the largest layer may be a dense one."""
        if autoep == 1 or not self.largest_experts:
            return self.largest_layer
        return max(self.largest_dense, self.largest_experts // autoep)


def count_module(module: nn.Module) -> tuple[int, int]:
    """(unique parameter count, largest layer's own parameter count) of a module."""
    total = sum({id(p): p.numel() for p in module.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    return total, largest


def count_experts(module: nn.Module) -> tuple[int, int, int, int]:
    """(elements of the fused routed experts, experts per layer, the largest experts module's own elements, the
    largest other module's own elements) as `expert_parallel` finds them (moe/auto.py)."""
    from zeroshard.moe.auto import is_fused_experts, num_experts

    found = [m for m in module.modules() if is_fused_experts(m)]
    own = {id(m): sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()}
    elements = sum(own[id(m)] for m in found)
    ids = {id(m) for m in found}
    dense = max((n for i, n in own.items() if i not in ids), default=0)
    return elements, max((num_experts(m) for m in found), default=0), max((own[i] for i in ids), default=0), dense


def count_matrices(module: nn.Module) -> int:
    """Elements of the parameters Muon's matrix half steps (DeepSpeed's rule, tied weights once)."""
    from zeroshard.optim.muon import uses_muon

    return sum(p.numel() for name, p in module.named_parameters() if uses_muon(name, p.shape))


def shape_of(config: Any, module: nn.Module | None = None) -> Shape:
    """The activation shape of a transformers config (Llama/Qwen2/Mistral-style and GPT-2-style names)."""
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
    heads = int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 1))
    kv = getattr(config, "num_key_value_heads", None) or heads
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
    names = [name for name, _ in module.named_modules()] if module is not None else []
    gated = any(name.endswith("gate_proj") for name in names) or _fused_experts(module)
    qk_norm = any(name.endswith("q_norm") for name in names)
    experts = [name for name in names if name.endswith(".experts")]
    moe = _moe_shape(config, len(experts), int(inter), _in_last_layer(experts, layers))
    mla = _mla_shape(config)
    eager = None
    if str(getattr(getattr(module, "config", None), "_attn_implementation", "")) == "eager":
        softcap = bool(getattr(config, "attn_logit_softcapping", None))
        sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ())
        eager = EagerShape(softcap, fp32_softmax=getattr(config, "model_type", "") != "gpt_oss", masks=1 + sliding)
    norms = _norms_per_layer(module)
    final_softcap = bool(getattr(config, "final_logit_softcapping", None))
    sizes = (hidden, layers, heads, int(kv), int(inter), int(config.vocab_size))
    return Shape(*sizes, gated, qk_norm, moe, mla, eager, norms, final_softcap)


_LAYER_ZERO = re.compile(r"(^|\.)(layers|layer|h|blocks)\.0$")
_HEAD_NORMS = frozenset({"q_norm", "k_norm", "q_layernorm", "k_layernorm"})


def _norms_per_layer(module: nn.Module | None) -> int:
    """The norms directly in the first decoder layer (Gemma-2/3: four; Cohere's parallel block: one), not the
    per-head q/k norms; two where no layer is found."""
    if module is None:
        return 2
    layer = next((m for name, m in module.named_modules() if _LAYER_ZERO.search(name)), None)
    if layer is None:
        return 2
    norms = [n for n, child in layer.named_children() if "Norm" in type(child).__name__ and n not in _HEAD_NORMS]
    return max(len(norms), 1)


def _mla_shape(config: Any) -> MlaShape | None:
    """[Note: activation estimate of MLA] from a DeepSeek-V2/V3 config (`kv_lora_rank` and the head dimensions)."""
    kv_lora = getattr(config, "kv_lora_rank", None)
    if not kv_lora:
        return None
    dims = [int(getattr(config, k, 0) or 0) for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")]
    return MlaShape(int(getattr(config, "q_lora_rank", 0) or 0), int(kv_lora), *dims)


def _fused_experts(module: nn.Module | None) -> bool:
    """A model whose every MLP is fused experts (Mixtral: `experts.gate_up_proj`) is gated too."""
    return module is not None and any(n.endswith("experts.gate_up_proj") for n, _ in module.named_parameters())


def _in_last_layer(names: list[str], layers: int) -> bool:
    """Whether one of `names` (module paths) is inside the last decoder layer (`....layers.<layers - 1>....`)."""
    return any(f".{layers - 1}." in f".{name}." and ".layers." in f".{name}" for name in names)


def _moe_shape(config: Any, moe_layers: int, intermediate: int, last: bool = True) -> MoeShape | None:
    """[Note: activation estimate of experts] from a transformers MoE config (Qwen2/3-MoE, Mixtral, DeepSeek names)."""
    experts = next((getattr(config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts") if
                    getattr(config, k, None)), 0)  # fmt: skip
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if not (moe_layers and experts and top_k):
        return None
    expert = int(getattr(config, "moe_intermediate_size", 0) or intermediate)
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    shared = shared or int(getattr(config, "n_shared_experts", 0) or 0) * expert
    activation = 8 if getattr(config, "model_type", "") == "gpt_oss" else 4  # [Note: GPT-OSS experts]
    return MoeShape(moe_layers, int(experts), top_k, expert, shared, last_layer=last, activation=activation)


ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def from_hf_config(name: str, config: Any, attention: str | None = None) -> ModelInfo:
    """`attention`: the `attn_implementation` training will use (None: the model's default)."""
    import torch
    from transformers import AutoModelForCausalLM

    # only eager changes what is kept: a fused kernel is checked against the model's support, not built (its package
    # may be missing where the estimate runs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, **({"attn_implementation": "eager"} if attention == "eager" else {})
        )
    if attention not in (None, "eager"):
        flag = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}.get(
            attention, "_supports_flash_attn"
        )
        if not getattr(model, flag, False):
            raise ConfigError(f"--attn-implementation {attention}: {type(model).__name__} does not support it")
        model.config._attn_implementation = attention
    total, largest = count_module(model)
    experts, num_experts, largest_experts, largest_dense = count_experts(model)
    shape = shape_of(config, model)
    matrices = count_matrices(model)
    return ModelInfo(
        name,
        total,
        largest,
        shape,
        matrices=matrices,
        experts=experts,
        num_experts=num_experts,
        largest_experts=largest_experts,
        largest_dense=largest_dense,
    )


def from_model_arg(model: str, attention: str | None = None) -> ModelInfo:
    """`--model`: a Hugging Face model folder (its config.json) or a built-in config name; `attention` as in
    `from_hf_config`."""
    from zeroshard.presets import model_preset

    if os.path.isdir(model):
        from transformers import AutoConfig

        if not os.path.exists(os.path.join(model, "config.json")):
            raise ConfigError(f"model folder {model} has no config.json; pass a Hugging Face model folder")
        return from_hf_config(model, AutoConfig.from_pretrained(model), attention)
    preset = model_preset(model)
    return from_hf_config(preset.name, preset.hf_config(vocab_size=259), attention)


def from_params(params: float, vocab: int = 32000, eager: bool = False) -> ModelInfo:
    """A Llama-like shape with `params` parameters: 12·L·h² + 2·V·h with L = h/128 (Llama-2 7B/13B, GPT-3)."""
    if params <= 0:
        raise ConfigError(f"--params {params:g} must be positive")
    hidden = max(64, round((params * 128 / 12) ** (1 / 3) / 64) * 64)
    layers = max(1, round(params / (12 * hidden * hidden)))
    heads = max(1, hidden // 128)
    intermediate = int(math.ceil(8 * hidden / 3 / 64) * 64)  # SwiGLU's 8/3 h, rounded as Llama does
    shape = Shape(hidden, layers, heads, heads, intermediate, vocab, True, eager=EagerShape() if eager else None)
    largest = max(vocab * hidden, shape.intermediate * hidden)
    note = (
        f"Llama-like shape assumed: hidden {hidden}, {layers} layers, vocabulary {vocab}; --model gives exact numbers"
    )
    embeddings = 2 * vocab * hidden  # the embedding and the head: Muon leaves them to Adam
    matrices = max(0, int(params) - embeddings)
    return ModelInfo(f"{params:.3g} parameters", int(params), largest, shape, note, matrices)
