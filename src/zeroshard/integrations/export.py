"""The end of a run: a Hugging Face folder of the fp32 weights, a logits probe, and a sample generation.

[Note: where the fp32 weights come from]
With bf16/fp16 (and with stage 3 in any dtype) the full-precision values are the fp32 master shards, spread
over the ranks: `gathered_fp32_state_dict` asks the engine to consolidate them (`Strategy.consolidated_params`,
every stage), so the export never upcasts compute-dtype weights.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
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
    folder = folder.rstrip(os.sep)
    if not _is_peft(model):
        with _committed(folder) as (writing,):
            model.save_pretrained(writing, state_dict=state, safe_serialization=True)  # type: ignore[operator]
            tokenizer.save_pretrained(writing)
        return None
    adapter_folder = folder + "-adapter"
    with _committed(folder, adapter_folder) as (writing, adapter_writing):
        model.save_pretrained(adapter_writing, state_dict=state)  # type: ignore[operator]
        _merged_copy(model, state).save_pretrained(writing, safe_serialization=True)  # type: ignore[operator]
        tokenizer.save_pretrained(writing)
    return adapter_folder


@contextlib.contextmanager
def _committed(*folders: str) -> Iterator[list[str]]:
    """Folders to write `folders` into: temporary ones beside them, put in their places (earlier exports replaced)
    only once everything is written and synced, so an interrupted export (Ctrl-C, a failure) leaves the earlier
    folders, never weights without their tokenizer or an adapter of another run ([Note: crash safety] in
    checkpoint/atomic.py: the same commit)."""
    from zeroshard.checkpoint.atomic import commit_directory, fsync_tree

    nonce = uuid.uuid4().hex[:12]
    places = [os.path.split(os.path.abspath(folder)) for folder in folders]
    temporary = [os.path.join(parent, f".tmp.{name}.{nonce}") for parent, name in places]
    try:
        for tmp in temporary:
            os.makedirs(tmp)
        yield temporary
        for tmp in temporary:
            for dirpath, _, files in os.walk(tmp):
                for file in files:
                    with open(os.path.join(dirpath, file), "rb") as handle:
                        os.fsync(handle.fileno())
            fsync_tree(tmp)
    except BaseException:
        for tmp in temporary:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    for tmp, (parent, name) in zip(temporary, places, strict=True):
        commit_directory(tmp, os.path.join(parent, name), nonce, rank=0)


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
