"""[Note: converted checkpoints in a streaming load]: a fused tensor's runs of stored elements equal what transformers'
own conversion operations build from the same tensors; a range read piece by piece equals the slice; a converter
with another operation is refused in one line naming it."""

from __future__ import annotations

import math

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
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in stored.items()}
    operations = [MergeModulelist(dim=0), Concatenate(dim=dim)]
    built = _compose(operations, patterns, by_pattern, shapes)
    assert not isinstance(built, str)
    tensors = {p: [stored[k] for k in keys] for p, keys in by_pattern.items()}
    for op in operations:
        tensors = op.convert(tensors, source_patterns=patterns, target_patterns=["experts.gate_up_proj"])
    (expected,) = tensors.values()
    composite = Composite.of(built.shape, torch.float32, built.runs)
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

    shapes = {"e.0.w": ((2, 3), torch.float32), "e.1.w": ((2, 3), torch.float32), "e.2.w": ((3, 3), torch.float32)}
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
