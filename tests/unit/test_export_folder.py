"""The end-of-run Hugging Face export (`zeroshard train`'s final/): written beside, put in place whole."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from zeroshard.integrations.export import export_hf_folder
from zeroshard.integrations.tokenizer import byte_tokenizer


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=259, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


class _Interrupted:
    """A tokenizer whose save is interrupted (Ctrl-C) after the weights were written."""

    def save_pretrained(self, folder: str) -> None:
        raise KeyboardInterrupt


def _weights(folder) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("peft", [False, True])
def test_an_interrupted_export_leaves_the_earlier_one_whole(tmp_path, peft):
    """A Ctrl-C during the export left final/ with the new weights and no tokenizer (written in place): now the
    earlier export stays as it was, nothing half-written beside it; a finished export replaces it."""
    folder = str(tmp_path / "final")
    first, second = _model(0), _model(1)
    if peft:
        from peft import LoraConfig, get_peft_model

        first, second = (get_peft_model(m, LoraConfig(r=2, target_modules=["q_proj"])) for m in (first, second))
    state = {k: v.detach().clone() for k, v in first.state_dict().items()}
    adapter = export_hf_folder(first, state, byte_tokenizer(), folder)
    assert (adapter is not None) == peft
    before = sorted(os.listdir(folder))
    assert "tokenizer_config.json" in before and "model.safetensors" in before
    kept, kept_adapter = _weights(folder), _adapter(adapter)
    with pytest.raises(KeyboardInterrupt):
        export_hf_folder(second, dict(second.state_dict()), _Interrupted(), folder)
    assert sorted(os.listdir(folder)) == before
    assert all(torch.equal(kept[k], v) for k, v in _weights(folder).items())
    assert _adapter(adapter).keys() == kept_adapter.keys()  # the adapter of the same export, not the new one
    assert all(torch.equal(kept_adapter[k], v) for k, v in _adapter(adapter).items())
    assert sorted(os.listdir(tmp_path)) == (["final", "final-adapter"] if peft else ["final"])
    export_hf_folder(second, dict(second.state_dict()), byte_tokenizer(), folder)
    assert sorted(os.listdir(folder)) == before
    assert sorted(os.listdir(tmp_path)) == (["final", "final-adapter"] if peft else ["final"])
    assert any(not torch.equal(kept[k], v) for k, v in _weights(folder).items())
    if peft:
        assert any(not torch.equal(kept_adapter[k], v) for k, v in _adapter(adapter).items())


def _adapter(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {} if folder is None else load_file(os.path.join(folder, "adapter_model.safetensors"))
