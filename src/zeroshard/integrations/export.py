"""The end of a run: a Hugging Face folder of the fp32 weights, a logits probe, and a sample generation.

[Note: where the fp32 weights come from]
With fp32 training and stages 0-2 every rank's module holds the full fp32 parameters. With bf16/fp16
the full-precision values are the fp32 master shards, spread over the ranks; `gathered_fp32_state_dict`
all-gathers them (stages 1-2) using the engine's flat layout. An engine method
`consolidated_state_dict(dtype)` takes precedence when the engine has one (the stage-3 engine should
provide it); otherwise parameters are read from the module and upcast, with a warning if that loses
the master weights' precision.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def gathered_fp32_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The model's full state dict in fp32 on CPU; a collective (every rank calls it)."""
    consolidated = getattr(engine, "consolidated_state_dict", None)
    if callable(consolidated):
        return {k: v.detach().float().cpu() for k, v in consolidated(dtype=torch.float32).items()}
    module: nn.Module = engine.module
    full = _masters_by_param(engine)
    if not full and engine.precision.compute_dtype != torch.float32:
        log_rank(logger, 30, "no fp32 master weights to gather: exporting the compute-dtype weights upcast to fp32")
    state = {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu() for k, v in module.state_dict().items()}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in full and name in state:
            state[name] = full[id(param)].view(param.shape).clone()
    return state


def _masters_by_param(engine: Any) -> dict[int, torch.Tensor]:
    """id(parameter) -> its full fp32 value from the master shards (stages 1-2 with a non-fp32 compute dtype)."""
    zero = getattr(engine, "zero", None)
    if zero is None or engine.zero_stage > 2 or engine.precision.compute_dtype == torch.float32:
        return {}
    with zero.optimizer_state_resident():  # NVMe offload: read the masters in for the export
        return _gather_masters(engine, zero)


def _gather_masters(engine: Any, zero: Any) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    shards = zero.layout.shard_count
    for buffers in zero.buffers:
        layout = buffers.layout
        gathered = torch.empty(layout.shard_numel * shards, dtype=torch.float32, device=buffers.master.device)
        if shards > 1:
            engine.comm.all_gather(gathered, buffers.master)
        else:
            gathered.copy_(buffers.master)
        full = torch.empty(layout.numel, dtype=torch.float32)
        for bucket in layout.buckets:
            for rank in range(shards):
                begin = bucket.start + rank * bucket.shard_numel
                source = rank * layout.shard_numel + bucket.shard_start
                full[begin : begin + bucket.shard_numel] = gathered[source : source + bucket.shard_numel].cpu()
        for slot in layout.slots:
            out[id(buffers.params[slot.index])] = full[slot.offset : slot.offset + slot.numel]
    return out


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
