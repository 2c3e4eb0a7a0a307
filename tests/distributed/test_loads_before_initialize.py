"""`load_state_dict` into a model `zero_init` built, before `initialize` ([Note: loads before initialize] in
zero/stage3/pending.py): PEFT's `PeftModel.from_pretrained(base, adapter)` on a meta base keeps the saved adapter
(its weights were dropped: torch skips meta tensors with a warning, and training started from a fresh LoRA), at
stages 2 and 3 and on the fsdp2 backend; a whole state dict loaded into a model built from a config, and a partial
one loaded over a `from_pretrained` checkpoint (the load wins), are what training starts from."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks

pytest.importorskip("peft")


def _config(stage: int, backend: str = "zero") -> dict[str, Any]:
    return {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zeroshard": {"backend": backend},
    }


def _tiny() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64,
    )  # fmt: skip


def _start(engine: Any, model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    import zeroshard

    named = dict(model.named_parameters())
    with zeroshard.GatheredParameters([named[n] for n in names]):
        values = {n: named[n].detach() for n in names}  # fsdp2: DTensors, whole inside the block
        values = {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for n, v in values.items()}
    tokens = torch.arange(8).view(1, 8)
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)
    return values


def _adapter(rank: int, world_size: int, base: str, adapter: str, stage: int, backend: str) -> dict[str, Any]:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    import zeroshard

    with zeroshard.zero_init():
        model = LlamaForCausalLM.from_pretrained(base)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(model, adapter, is_trainable=True)
    engine, *_ = zeroshard.initialize(model=model, config=_config(stage, backend))
    names = [n for n, _ in model.named_parameters() if "lora_" in n]
    out = {
        "values": _start(engine, model, names),
        "warned": [str(w.message) for w in caught if "meta" in str(w.message)],
    }
    engine.destroy()
    return out


@pytest.mark.parametrize(
    "stage, backend",
    [
        (3, "zero"),
        pytest.param(2, "zero", marks=pytest.mark.slow),
        pytest.param(3, "fsdp2", marks=pytest.mark.slow),
    ],  # CI budget: the default suite in 15 minutes on 2 AVX2 cores
)
def test_a_saved_lora_adapter_loads_onto_a_zero_init_base(tmp_path: Path, stage: int, backend: str) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(_tiny())
    base.save_pretrained(tmp_path / "base")
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.normal_()  # lora_B nonzero: a fresh adapter would differ
    saved = {n: p.detach().clone() for n, p in lora.named_parameters() if "lora_" in n}
    lora.save_pretrained(tmp_path / "adapter")
    for got in run_on_ranks(_adapter, 2, str(tmp_path / "base"), str(tmp_path / "adapter"), stage, backend):
        assert got["warned"] == []
        assert sorted(got["values"]) == sorted(saved)
        for name, value in saved.items():
            assert torch.equal(got["values"][name], value), name


def _whole(rank: int, world_size: int, folder: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    import zeroshard

    with zeroshard.zero_init():
        built = LlamaForCausalLM(_tiny())
        loaded = LlamaForCausalLM.from_pretrained(folder)
    built.load_state_dict(state)  # every tensor
    some = {k: v for k, v in state.items() if ".0." in k}
    loaded.load_state_dict(some, strict=False)  # layer 0 over the checkpoint's values
    out = {}
    for tag, model in (("built", built), ("loaded", loaded)):
        engine, *_ = zeroshard.initialize(model=model, config=_config(3))
        values = _start(engine, model, [n for n, _ in model.named_parameters()])
        out.update({f"{tag}.{n}": v for n, v in values.items()})
        engine.destroy()
    return out


def test_a_state_dict_loaded_before_initialize_is_the_start(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    stored = LlamaForCausalLM(_tiny())
    stored.save_pretrained(tmp_path)
    torch.manual_seed(2)
    state = LlamaForCausalLM(_tiny()).state_dict()  # another model's values
    for got in run_on_ranks(_whole, 2, str(tmp_path), state):
        for name, p in stored.named_parameters():
            assert torch.equal(got[f"built.{name}"], state[name]), name
            expected = state[name] if ".0." in name else p.detach()
            assert torch.equal(got[f"loaded.{name}"], expected), name


def _saved_copy(rank: int, world_size: int, folder: str | None) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    import zeroshard

    torch.manual_seed(3)
    with zeroshard.zero_init():
        model = LlamaForCausalLM.from_pretrained(folder) if folder else LlamaForCausalLM(_tiny())
    lora = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    model = get_peft_model(model, lora)
    engine, *_ = zeroshard.initialize(model=model, config=_config(3))
    head = model.base_model.model.lm_head
    pair = [head.original_module.weight, head.modules_to_save["default"].weight]
    with zeroshard.GatheredParameters(pair):
        out = {"original": pair[0].detach().clone(), "copy": pair[1].detach().clone()}
    engine.destroy()
    return out


@pytest.mark.parametrize(
    "from_checkpoint", [True, pytest.param(False, marks=pytest.mark.slow)]
)  # CI budget: the default suite in 15 minutes on 2 AVX2 cores
def test_modules_to_save_copies_start_as_their_originals(tmp_path: Path, from_checkpoint: bool) -> None:
    """PEFT's `modules_to_save` trains a deep copy of the module, made on the meta device: it starts from the
    original's values (the checkpoint's, or the recorded initialisation), not from `reset_parameters()`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    stored = LlamaForCausalLM(_tiny())
    stored.save_pretrained(tmp_path)
    for got in run_on_ranks(_saved_copy, 2, str(tmp_path) if from_checkpoint else None):
        assert torch.equal(got["copy"], got["original"])
        if from_checkpoint:
            assert torch.equal(got["original"], stored.lm_head.weight)
        else:  # Llama's _init_weights: normal(0, 0.02)
            assert 0.015 < got["copy"].std().item() < 0.025


class _Buffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("kept", torch.zeros(4))
        self.register_buffer("scratch", torch.arange(4.0), persistent=False)


def _edges(rank: int, world_size: int, base: str, adapter: str) -> dict[str, Any]:
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import LlamaForCausalLM

    import zeroshard

    out: dict[str, Any] = {}
    with zeroshard.zero_init():
        model = LlamaForCausalLM.from_pretrained(base)
        small = _Buffers()
    # after a block before initialize (its agreement holds a process group), copies of hooked modules still work
    with zeroshard.GatheredParameters([model.model.norm.weight], modifier_rank=0):
        pass
    copied = copy.deepcopy(small)
    out["copied"] = copied is not small
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    # torch never loads a non-persistent buffer
    small.load_state_dict({"linear.weight": torch.ones(4, 4), "linear.bias": torch.ones(4), "kept": torch.ones(4),
                           "scratch": torch.full((4,), 7.0)}, strict=False)  # fmt: skip
    out["kept"], out["scratch_meta"] = small.kept.clone(), small.scratch.is_meta
    for tag, kwargs in (("assign", {"low_cpu_mem_usage": True}), ("tokens", {})):
        with zeroshard.zero_init():
            base_model = LlamaForCausalLM.from_pretrained(base)
        try:
            if tag == "assign":  # PEFT loads the adapter with assign=True, then moves it to the base's meta device
                PeftModel.from_pretrained(base_model, adapter, **kwargs)
            else:
                tokens = get_peft_model(base_model, LoraConfig(target_modules=["q_proj"], trainable_token_indices=[1]))
                zeroshard.initialize(model=tokens, config=_config(3))
            out[tag] = "accepted"
        except Exception as e:  # noqa: BLE001 - the message is the test
            out[tag] = str(e)
    return out


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by loads before initialize:
# test_a_state_dict_loaded_before_initialize_is_the_start
@pytest.mark.slow
def test_copies_buffers_assign_loads_and_trainable_tokens(tmp_path: Path) -> None:
    """A hooked module deep-copies after a block before initialize; non-persistent buffers are not loaded; PEFT's
    low_cpu_mem_usage=True load (assign=True, then moved to meta) and trainable_token_indices on a zero_init base are
    refused in one line each (they dropped the adapter, or left the tokens' rows zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(_tiny()).save_pretrained(tmp_path / "base")
    lora = get_peft_model(LlamaForCausalLM(_tiny()), LoraConfig(r=2, target_modules=["q_proj"]))
    lora.save_pretrained(tmp_path / "adapter")
    for got in run_on_ranks(_edges, 2, str(tmp_path / "base"), str(tmp_path / "adapter")):
        assert got["copied"]
        assert torch.equal(got["kept"], torch.ones(4)) and got["scratch_meta"]
        assert (
            got["assign"].startswith("load_state_dict(assign=True) into ")
            and "low_cpu_mem_usage=False" in got["assign"]
        )
        assert got["tokens"].startswith("PEFT's trainable_token_indices around a model built under zero_init")
