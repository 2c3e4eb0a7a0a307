"""Named model architectures: small ones to train from random weights, and published shapes for `estimate`.

A preset is a Hugging Face `model_type` plus the settings of its config class; `hf_config()` builds
the config without any download. Presets whose `vocab_size` is None take the tokenizer's size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from zeroshard.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelPreset:
    """One named architecture."""

    name: str
    model_type: str  # a transformers model_type: "llama", "qwen2", "gpt2"
    settings: Mapping[str, Any]
    summary: str
    vocab_size: int | None = None  # None: the tokenizer's vocabulary size
    trainable_here: bool = field(default=True)  # small enough to train on a laptop CPU

    @property
    def hidden_size(self) -> int:
        return int(self.settings.get("hidden_size", self.settings.get("n_embd", 0)))

    def hf_config(self, vocab_size: int | None = None, **overrides: Any) -> PretrainedConfig:
        """The transformers config (`vocab_size` is used when the preset does not fix one)."""
        from transformers import AutoConfig

        vocab = self.vocab_size or vocab_size
        if vocab is None:
            raise ConfigError(f"model preset {self.name} takes its vocabulary size from the tokenizer; pass one")
        return AutoConfig.for_model(self.model_type, vocab_size=vocab, **{**self.settings, **overrides})


def _llama(hidden: int, inter: int, layers: int, heads: int, kv: int, positions: int, **extra: Any) -> dict[str, Any]:
    return {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": positions,
        **extra,
    }


def _gpt2(hidden: int, layers: int, heads: int, positions: int) -> dict[str, Any]:
    return {"n_embd": hidden, "n_layer": layers, "n_head": heads, "n_positions": positions}


def _published(name: str, model_type: str, settings: dict[str, Any], summary: str, vocab_size: int) -> ModelPreset:
    """A published architecture: its own vocabulary, and too large to train on a laptop CPU."""
    return ModelPreset(name, model_type, settings, summary, vocab_size=vocab_size, trainable_here=False)


_ALL: Final = (
    ModelPreset("tiny-llama", "llama", _llama(64, 128, 2, 4, 2, 512), "Llama, 2 layers, hidden 64 (tests)"),
    ModelPreset(
        "tiny-qwen2", "qwen2", _llama(64, 128, 2, 4, 2, 512, tie_word_embeddings=True), "Qwen2, 2 layers, hidden 64"
    ),
    ModelPreset("tiny-gpt2", "gpt2", _gpt2(64, 2, 4, 512), "GPT-2, 2 layers, hidden 64"),
    ModelPreset("small-llama", "llama", _llama(256, 688, 4, 4, 4, 1024), "Llama, 4 layers, hidden 256 (~3.3M)"),
    ModelPreset("small-qwen2", "qwen2", _llama(256, 688, 4, 4, 2, 1024, tie_word_embeddings=True), "Qwen2, ~3M"),
    ModelPreset("small-gpt2", "gpt2", _gpt2(256, 4, 4, 1024), "GPT-2, 4 layers, hidden 256"),
    # Published shapes (random weights if trained); mostly for `zeroshard estimate`.
    _published("gpt2", "gpt2", _gpt2(768, 12, 12, 1024), "GPT-2 124M", 50257),
    _published(
        "qwen2-0.5b", "qwen2", _llama(896, 4864, 24, 14, 2, 32768, tie_word_embeddings=True), "Qwen2-0.5B", 151936
    ),
    _published(
        "qwen2-7b", "qwen2", _llama(3584, 18944, 28, 28, 4, 32768, tie_word_embeddings=False), "Qwen2-7B", 152064
    ),
    _published("llama-2-7b", "llama", _llama(4096, 11008, 32, 32, 32, 4096), "Llama-2 7B", 32000),
    _published("llama-2-13b", "llama", _llama(5120, 13824, 40, 40, 40, 4096), "Llama-2 13B", 32000),
    _published("llama-2-70b", "llama", _llama(8192, 28672, 80, 64, 8, 4096), "Llama-2 70B", 32000),
    _published("llama-3-8b", "llama", _llama(4096, 14336, 32, 32, 8, 8192, rope_theta=500000.0), "Llama-3 8B", 128256),
    _published(
        "llama-3.1-405b",
        "llama",
        _llama(16384, 53248, 126, 128, 8, 131072, rope_theta=500000.0),
        "Llama-3.1 405B",
        128256,
    ),
)

MODEL_PRESETS: Final[Mapping[str, ModelPreset]] = MappingProxyType({p.name: p for p in _ALL})


def model_preset(name: str) -> ModelPreset:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model {name!r}: not a folder and not a built-in config ({', '.join(MODEL_PRESETS)})"
        ) from None
