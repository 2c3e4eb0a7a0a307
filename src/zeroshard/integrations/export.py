"""The end of a run: a Hugging Face folder of the fp32 weights, a logits probe, and a sample generation.

[Note: where the fp32 weights come from]
With bf16/fp16 (and with stage 3 in any dtype) the full-precision values are the fp32 master shards, spread
over the ranks: `gathered_fp32_state_dict` asks the engine to consolidate them (`Strategy.consolidated_params`,
every stage), so the export never upcasts compute-dtype weights.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard.utils.logging import get_logger

if TYPE_CHECKING:
    from zeroshard.engine import Engine

logger = get_logger(__name__)


def gathered_fp32_state_dict(engine: Engine, keep: bool = True) -> dict[str, torch.Tensor]:
    """The model's full state dict in fp32 on CPU, from the master weights; a collective (every rank calls it), a
    rank with `keep` False gets {}."""
    state = engine.consolidated_state_dict(torch.float32, keep, torch.device("cpu"))  # unit by unit to the host
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def export_hf_folder(model: nn.Module, state: dict[str, torch.Tensor], tokenizer: Any, folder: str) -> str | None:
    """Write `folder` (config, safetensors weights, generation config, tokenizer) on the calling rank.

    A peft model also writes its adapter to `folder + "-adapter"` and exports the merged weights;
    returns the adapter folder, or None.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress lines say what happens
    os.makedirs(folder, exist_ok=True)
    adapter_folder = None
    if _is_peft(model):
        adapter_folder = folder.rstrip(os.sep) + "-adapter"
        model.save_pretrained(adapter_folder, state_dict=state)  # type: ignore[operator]
        merged = _merged_copy(model, state)
        merged.save_pretrained(folder, safe_serialization=True)  # type: ignore[operator]
    else:
        model.save_pretrained(folder, state_dict=state, safe_serialization=True)  # type: ignore[operator]
    tokenizer.save_pretrained(folder)
    return adapter_folder


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def _merged_copy(model: Any, state: dict[str, torch.Tensor]) -> nn.Module:
    """A fresh fp32 copy of the peft model with `state` loaded and the adapters merged into the base."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(model.get_base_model().config, dtype=torch.float32)
    fresh = get_peft_model(base, model.peft_config["default"])
    fresh.load_state_dict(state, strict=True)
    return fresh.merge_and_unload()


def load_exported(folder: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def probe_logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids).logits.float().cpu()


@torch.no_grad()
def sample(model: nn.Module, tokenizer: Any, prompt: str, new_tokens: int, seed: int = 0) -> str:
    """Top-k sampling at temperature 0.8 from a fixed seed: the same text for the same weights."""
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    torch.manual_seed(seed)
    output = model.generate(  # type: ignore[operator]
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=True,
        temperature=0.8,
        top_k=50,
        pad_token_id=tokenizer.pad_token_id,
    )
    return str(tokenizer.decode(output[0], skip_special_tokens=True))
