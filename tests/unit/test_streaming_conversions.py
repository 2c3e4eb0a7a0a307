"""[Note: converted checkpoints in a streaming load]: a fused tensor's runs of stored elements equal what transformers'
own conversion operations build from the same tensors; a range read piece by piece equals the slice; a converter
with another operation is refused in one line naming it."""

from __future__ import annotations

import math
import re

import pytest
import torch

from zeroshard.errors import ConfigError
from zeroshard.loading.convert import Composite, _compose

pytest.importorskip("transformers")


def _flat(composite: Composite, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([stored[key].reshape(-1)[first : first + count] for key, first, count in composite.runs])


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_stacked_and_concatenated_runs_equal_transformers_operations(dim):
    from transformers.core_model_loading import Concatenate, MergeModulelist

    experts, shape = 3, (4, 5)
    patterns = ["experts.*.gate_proj.weight", "experts.*.up_proj.weight"]
    stored = {f"experts.{e}.{p}_proj.weight": torch.randn(shape) for e in range(experts) for p in ("gate", "up")}
    by_pattern = {
        pattern: [f"experts.{e}.{pattern.split('.')[2]}.weight" for e in range(experts)] for pattern in patterns
    }
    shapes = {k: tuple(v.shape) for k, v in stored.items()}
    operations = [MergeModulelist(dim=0), Concatenate(dim=dim)]
    built = _compose(operations, patterns, by_pattern, shapes)
    assert not isinstance(built, str)
    tensors = {p: [stored[k] for k in keys] for p, keys in by_pattern.items()}
    for op in operations:
        tensors = op.convert(tensors, source_patterns=patterns, target_patterns=["experts.gate_up_proj"])
    (expected,) = tensors.values()
    composite = Composite.of(built.shape, built.runs)
    assert composite.shape == tuple(expected.shape)
    assert torch.equal(_flat(composite, stored), expected.reshape(-1))
    numel = math.prod(composite.shape)
    for start, stop in [(0, numel), (3, 17), (19, 21), (numel - 7, numel)]:  # across run boundaries
        out = torch.empty(stop - start)
        for key, lo, hi, at in composite.pieces(start, stop):
            out[at : at + hi - lo] = stored[key].reshape(-1)[lo:hi]
        assert torch.equal(out, expected.reshape(-1)[start:stop]), (start, stop)


def test_other_operations_and_uneven_experts_are_not_placements():
    from transformers.core_model_loading import MergeModulelist, Transpose

    shapes = {"e.0.w": (2, 3), "e.1.w": (2, 3), "e.2.w": (3, 3)}
    assert "Transpose" in str(_compose([Transpose(0, 1)], ["e.*.w"], {"e.*.w": ["e.0.w"]}, shapes))
    uneven = _compose([MergeModulelist(dim=0)], ["e.*.w"], {"e.*.w": ["e.0.w", "e.2.w"]}, shapes)
    assert isinstance(uneven, str) and "different shapes" in uneven


def test_a_checkpoint_needing_another_operation_is_refused_naming_it(tmp_path, monkeypatch):
    import transformers.conversion_mapping as mapping
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    import zeroshard
    from helpers.hf_moe import save_moe

    folder = str(tmp_path / "qwen3")
    save_moe("qwen3_moe", folder)
    transposing = WeightConverter(
        "mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [MergeModulelist(dim=0), Transpose(1, 2)]
    )
    original = mapping.get_model_conversion_mapping
    monkeypatch.setattr(mapping, "get_model_conversion_mapping", lambda model: [transposing, *original(model)])
    from transformers import AutoModelForCausalLM

    with pytest.raises(ConfigError, match=r"mlp\.experts\.down_proj.*Transpose.*without zeroshard\.zero_init"):
        with zeroshard.zero_init():
            AutoModelForCausalLM.from_pretrained(folder)


def _rewrite(folder: str, change) -> None:
    """The single-file checkpoint of `folder` written again with `change(tensors)` applied (a dict, in place)."""
    import os

    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _saved(tmp_path) -> str:
    from helpers.hf_moe import tiny_moe

    folder = str(tmp_path / "qwen3")
    tiny_moe("qwen3_moe").save_pretrained(folder)  # one file
    return folder


def _load(folder: str) -> None:
    from transformers import AutoModelForCausalLM

    import zeroshard

    with zeroshard.zero_init():
        AutoModelForCausalLM.from_pretrained(folder)


def test_quantized_checkpoints_are_refused_not_cast(tmp_path):
    """fp8 weights need their scales (transformers dequantizes them): by the config, or by a float8 tensor alone."""
    import json
    import os

    folder = _saved(tmp_path)
    key = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(folder, lambda t: t.update({key: t[key].to(torch.float8_e4m3fn)}))
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} is stored as torch.float8_e4m3fn"):
        _load(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ConfigError, match="quantized checkpoint .*quant_method 'fp8'"):
        _load(folder)


def test_experts_stored_with_a_gap_in_their_numbers_are_refused(tmp_path):
    """Experts 0, 1, 3, 4 of four would stack expert 3 into slot 2."""
    folder = _saved(tmp_path)

    def renumber(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if "layers.0.mlp.experts.2." in k]:
            tensors[key.replace("experts.2.", "experts.4.")] = tensors.pop(key)

    _rewrite(folder, renumber)
    with pytest.raises(ConfigError, match=r"layers\.0\.mlp\.experts\.\w+.*experts numbered \[0, 1, 3, 4\]"):
        _load(folder)


def test_a_conversion_in_place_that_changes_the_shape_is_named(tmp_path, monkeypatch):
    """A converter whose target keeps its source's name (qwen3_vl_moe transposes in place): the stored shape differs,
    and the refusal names the operation rather than the configuration."""
    import transformers.conversion_mapping as mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    folder = _saved(tmp_path)
    key = "model.layers.0.mlp.gate.weight"
    _rewrite(folder, lambda t: t.update({key: t[key].t().contiguous()}))
    transposing = WeightConverter("mlp.gate.weight", "mlp.gate.weight", [Transpose(0, 1)])
    original = mapping.get_model_conversion_mapping
    monkeypatch.setattr(mapping, "get_model_conversion_mapping", lambda model: [transposing, *original(model)])
    with pytest.raises(ConfigError, match=r"mlp\.gate\.weight.*Transpose"):
        _load(folder)


def test_mismatched_sizes_are_reported_as_transformers_reports_them(tmp_path):
    """`ignore_mismatched_sizes=True`: the tensors are initialised and listed under mismatched_keys only."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import zeroshard
    from helpers.hf_trainer import tiny_llama

    folder = str(tmp_path / "llama")
    tiny_llama(vocab=128).save_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    config.vocab_size = 100
    kwargs = {"config": config, "ignore_mismatched_sizes": True, "output_loading_info": True}
    _, expected = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    with zeroshard.zero_init():
        _, info = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    assert not info["missing_keys"] and not expected["missing_keys"]
    assert {(k, tuple(a), tuple(b)) for k, a, b in info["mismatched_keys"]} == {
        (k, tuple(a), tuple(b)) for k, a, b in expected["mismatched_keys"]
    }


def test_the_numbering_gap_is_found_whatever_way_the_pattern_is_written():
    """transformers writes some converters' patterns as regular expressions (DeepSeek-V4: `\\.experts.*.w1.weight`)."""
    from zeroshard.loading.convert import _numbering_gap

    keys = [f"model.layers.0.experts.{e}.w1.weight" for e in (0, 1, 3)]
    for pattern in (r"\.experts.*.w1.weight", ".experts.*.w1.weight"):
        assert "experts numbered [0, 1, 3]" in str(_numbering_gap({pattern: keys}))
        assert _numbering_gap({pattern: keys[:2]}) is None
