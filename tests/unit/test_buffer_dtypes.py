"""Buffer dtypes under bf16/fp16 ([Note: buffer dtypes] in precision/buffers.py): buffers keep their dtype unless
`data_types.buffer_dtype` names one, and `keep_in_fp32_modules` keeps the named ones in fp32, as DeepSpeed 0.19.8's
engine does; the name matching compared with DeepSpeed's own `keep_in_fp32` functions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.errors import ConfigError
from zeroshard.precision.buffers import buffers_matching, keep_in_fp32_pattern


class Router(nn.Module):
    """A routing bias whose values differ by less than bf16's spacing near 10 (DeepSeek-V3's kind of buffer)."""

    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 4, bias=False)
        self.register_buffer("e_score_correction_bias", 10 + torch.arange(4, dtype=torch.float32) * 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) + self.e_score_correction_bias.to(x.dtype)


class Net(nn.Module):
    _keep_in_fp32_modules = ["inv_freq"]  # kept under fp16 only

    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.rope = nn.Module()
        self.rope.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, 2).float() / 4))
        self.register_buffer("scale", torch.ones(()))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.router(x) * self.scale.to(x.dtype)).float().pow(2).mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("setting", ["auto", ["inv_freq"], ["router.*bias", "scale"], []])
def test_names_kept_match_deepspeed(dtype: torch.dtype, setting: Any) -> None:
    ds = import_deepspeed("deepspeed.runtime.keep_in_fp32")
    model = Net()
    ours, theirs = keep_in_fp32_pattern(model, setting, dtype), ds.keep_in_fp32_pattern(model, setting, dtype)
    assert (ours is None) == (theirs is None)
    if ours is not None:
        assert ours.pattern == theirs.pattern
        names = [n for n, _ in buffers_matching(model, ours)]
        by_id = {id(b): n for n, b in model.named_buffers()}
        assert names == [by_id[id(b)] for b in ds.buffers_to_keep_in_fp32(model, theirs)]


def _engine(precision: dict, data_types: dict, stage: int, backend: str = "zero") -> Any:
    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "zeroshard": {"backend": backend},
        "data_types": data_types,
        **precision,
    }
    model = Net()
    model.router.register_buffer("half_born", torch.ones(2, dtype=torch.float16))
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _buffer_dtypes(engine: Any) -> dict[str, torch.dtype]:
    return {name: buf.dtype for name, buf in engine.module.named_buffers()}


BF16 = {"bf16": {"enabled": True}}
KEPT = {"router.e_score_correction_bias": torch.float32}  # the model's strict list, under bf16 and fp16


@pytest.mark.parametrize(("stage", "backend"), [(0, "zero"), (1, "zero"), (2, "zero"), (3, "zero"), (3, "fsdp2")])
def test_buffers_keep_their_dtype_unless_buffer_dtype_is_set(stage: int, backend: str) -> None:
    loaded = {"router.e_score_correction_bias": torch.float32, "router.half_born": torch.float16}
    loaded |= {"rope.inv_freq": torch.float32, "scale": torch.float32, "steps": torch.int64}
    engine = _engine(BF16, {}, stage, backend)
    assert _buffer_dtypes(engine) == loaded
    engine.backward(engine(torch.randn(2, 4, dtype=torch.bfloat16)))
    engine.step()
    assert next(engine.module.router.gate.parameters()).dtype == torch.bfloat16 or backend == "fsdp2"
    engine.destroy()
    engine = _engine(BF16, {"buffer_dtype": "bf16"}, stage, backend)
    cast = {name: torch.bfloat16 if dtype.is_floating_point else dtype for name, dtype in loaded.items()}
    assert _buffer_dtypes(engine) == cast | KEPT
    engine.destroy()


def test_keep_in_fp32_modules_names_and_upcasts_and_fp16_adds_the_model_list() -> None:
    engine = _engine(BF16, {"buffer_dtype": "fp16", "keep_in_fp32_modules": ["half_born", "scale"]}, 1)
    dtypes = _buffer_dtypes(engine)
    assert dtypes["router.half_born"] == dtypes["scale"] == torch.float32  # upcast from fp16, kept from the cast
    assert dtypes["router.e_score_correction_bias"] == dtypes["rope.inv_freq"] == torch.float16  # the list replaces
    engine.destroy()
    engine = _engine({"fp16": {"enabled": True}}, {"buffer_dtype": "fp16"}, 1)
    dtypes = _buffer_dtypes(engine)
    assert dtypes["rope.inv_freq"] == dtypes["router.e_score_correction_bias"] == torch.float32
    assert dtypes["scale"] == torch.float16
    engine.destroy()
    engine = _engine(BF16, {"buffer_dtype": "bf16", "keep_in_fp32_modules": []}, 1)
    assert _buffer_dtypes(engine)["router.e_score_correction_bias"] == torch.bfloat16
    engine.destroy()


def test_fp32_training_casts_nothing_and_warns_about_buffer_dtype(log: Any) -> None:
    engine = _engine({}, {"buffer_dtype": "bf16"}, 2)
    assert _buffer_dtypes(engine)["router.half_born"] == torch.float16
    assert _buffer_dtypes(engine)["scale"] == torch.float32
    engine.destroy()
    lines = [r.getMessage() for r in log.records]
    assert any("data_types.buffer_dtype" in line and "ignored in fp32" in line for line in lines), lines


def test_param_dtype_must_match_the_precision_mode() -> None:
    from zeroshard.config import parse_config

    base = {"train_micro_batch_size_per_gpu": 1}
    parse_config({**base, **BF16, "data_types": {"param_dtype": "bf16"}})
    with pytest.raises(ConfigError, match="data_types.param_dtype"):
        parse_config({**base, **BF16, "data_types": {"param_dtype": "fp16"}})
    with pytest.raises(ConfigError, match="parameters train in fp32"):
        parse_config({**base, "data_types": {"param_dtype": "bf16"}})
