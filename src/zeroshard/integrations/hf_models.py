"""Hugging Face causal LMs for `zeroshard train`: a local folder, or a built-in config with random weights.

A folder's model is built on the meta device and `initialize` reads each rank's part of its safetensors
straight into the shards (zeroshard.loading). Weights are fp32 (the engine casts to the compute dtype); LoRA
wraps the model with peft (frozen base, trainable adapters); activation checkpointing uses transformers'
non-reentrant mode,
whose recomputation runs inside autograd, so the engine's gradient hooks fire as usual.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.errors import ConfigError
from zeroshard.loading.hf import load_pretrained
from zeroshard.loading.materialize import materialize_adapters
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2")


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: Sequence[str] | None = None  # None: peft's default for the model type


@dataclass(frozen=True)
class ModelSpec:
    name: str  # a folder with config.json, or a built-in config name (zeroshard.presets.MODEL_PRESETS)
    tokenizer: str | None = None  # a tokenizer folder; None: the model folder's, else the byte-level default
    gradient_checkpointing: bool = False
    lora: LoraSpec | None = None

    @property
    def is_folder(self) -> bool:
        return os.path.isdir(self.name)


def check_model(spec: ModelSpec) -> None:
    """Fail fast on a model that is neither a folder with config.json nor a built-in name."""
    from zeroshard.presets import MODEL_PRESETS

    if spec.is_folder:
        if not os.path.exists(os.path.join(spec.name, "config.json")):
            raise ConfigError(f"model folder {spec.name} has no config.json; pass a Hugging Face model folder")
        check_weight_files(spec.name)
        return
    if spec.name not in MODEL_PRESETS:
        looks_like_path = os.sep in spec.name or spec.name.startswith(".")
        what = "model folder does not exist" if looks_like_path else "is not a built-in model config"
        raise ConfigError(
            f"--model {spec.name}: {what}; pass a local Hugging Face folder or one of {', '.join(MODEL_PRESETS)}"
        )


def check_weight_files(folder: str) -> None:
    """A model folder's safetensors weights (an index's shards too) open: present, whole (each tensor within its
    file, the index's names in their shards) and with headers the safetensors format allows; a ConfigError naming
    the file otherwise, before any process starts (each rank found it as it loaded, some with a traceback). Bytes
    are not read: a folder without safetensors files (`pytorch_model.bin`, config only) is left to its reader."""
    from zeroshard.checkpoint.errors import CheckpointError
    from zeroshard.loading.weights import SafetensorsFolder

    if not any(name.endswith((".safetensors", ".safetensors.index.json")) for name in os.listdir(folder)):
        return
    try:
        SafetensorsFolder(folder).close()
    except CheckpointError as err:
        raise ConfigError(f"--model {folder}: {err}") from None


def tokenizer_source(spec: ModelSpec) -> str | None:
    from zeroshard.integrations.tokenizer import has_tokenizer

    if spec.tokenizer is not None:
        return spec.tokenizer
    return spec.name if spec.is_folder and has_tokenizer(spec.name) else None


def build_model(spec: ModelSpec, tokenizer: Any, seq_len: int) -> nn.Module:
    """The model in fp32 on CPU, with checkpointing and LoRA applied as `spec` asks."""
    from transformers import AutoModelForCausalLM

    if spec.is_folder:  # a meta model: initialize streams each rank's part of the checkpoint ([Note: streaming load])
        model: Any = load_pretrained(AutoModelForCausalLM, spec.name, dtype=torch.float32)
    else:
        from zeroshard.presets import model_preset

        ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
        ids["bos_token_id"] = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        config = model_preset(spec.name).hf_config(vocab_size=len(tokenizer), **ids)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _check_fit(model.config, tokenizer, seq_len, spec.name)
    if model.config.model_type not in FAMILIES:
        log_rank(logger, 30, f"model type {model.config.model_type} is not tested with zeroshard train ({FAMILIES})")
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if spec.lora is not None:
        model = _with_lora(model, spec.lora)
    return model


def _check_fit(config: Any, tokenizer: Any, seq_len: int, name: str) -> None:
    vocab = int(config.vocab_size)
    if len(tokenizer) > vocab:
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} ids but model {name} has vocab_size {vocab}; "
            "use the model's own tokenizer (--tokenizer)"
        )
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and seq_len > int(positions):
        raise ConfigError(f"--seq-len {seq_len} exceeds model {name}'s {positions} positions")


DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's default for the Llama family


def lora_targets(model: nn.Module, targets: Sequence[str] | None) -> list[str] | None:
    """The modules LoRA adapts: the given ones; else peft's default for the model type (None); else, for a type
    peft has none for (Qwen2/3-MoE, DeepSeek at peft 0.18), the Llama family's q_proj and v_proj when the model has
    them; else ConfigError naming --lora-targets and the model's linear layers (peft's own error names neither)."""
    if targets:
        return list(targets)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in PEFT_DEFAULTS:
        return None
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    if all(t in linear for t in DEFAULT_TARGETS):
        log_rank(logger, 20, f"LoRA targets {', '.join(DEFAULT_TARGETS)} (peft has no default for {model_type!r})")
        return list(DEFAULT_TARGETS)
    raise ConfigError(
        f"peft has no default LoRA targets for model type {model_type!r}: pass --lora-targets (comma-separated "
        f"module names; this model's linear layers: {', '.join(linear[:16]) or 'none'})"
    )


def _with_lora(model: nn.Module, lora: LoraSpec) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int, uses it as a float
        lora_dropout=lora.dropout,
        target_modules=lora_targets(model, lora.targets),
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)  # type: ignore[arg-type]
    materialize_adapters(peft_model)  # adapters of a meta base: real now, lora_B zero
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log_rank(logger, 20, f"LoRA rank {lora.rank}: {trainable:,} trainable of {total:,} parameters")
    return peft_model
