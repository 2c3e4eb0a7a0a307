"""`zeroshard train --lora-rank` without --lora-targets: peft's default for the model type, else q_proj/v_proj
(a Qwen3-MoE, which peft has no default for), else one line naming --lora-targets and the linear layers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from helpers.hf_moe import tiny_moe
from helpers.hf_trainer import tiny_llama
from zeroshard.errors import ConfigError
from zeroshard.integrations.hf_models import lora_targets

pytest.importorskip("peft")


def test_peft_default_then_the_llama_family_projections():
    assert lora_targets(tiny_llama(), None) is None  # peft knows llama
    assert lora_targets(tiny_moe("qwen3_moe"), None) == ["q_proj", "v_proj"]
    assert lora_targets(tiny_moe("qwen3_moe"), ["o_proj"]) == ["o_proj"]


def test_no_default_and_no_projections_is_one_line_naming_the_option():
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(2, 2))
    model.config = SimpleNamespace(model_type="custom")  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"model type 'custom': pass --lora-targets .*linear layers: proj\)"):
        lora_targets(model, None)
