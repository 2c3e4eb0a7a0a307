"""`zeroshard.profiling.flops_profiler`: DeepSpeed's `get_model_profile` and `FlopsProfiler`, against numbers
DeepSpeed 0.19.8's `get_model_profile` gave on the same models (CPU, torch 2.13), recorded below.

[Note: flops profile] in monitor/flops.py: MACs and parameters equal DeepSpeed's; FLOPs leave out the element-wise
operations DeepSpeed counts (ReLU, LayerNorm, softmax, the residual adds), so they are smaller by those.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

from zeroshard.profiling.flops_profiler import FlopsProfiler, get_model_profile

# DeepSpeed 0.19.8: get_model_profile(model, ..., print_profile=False, as_string=False) -> (flops, macs, params)
DS_MLP = (800, 384, 212)  # input_shape=(2, 8); 800 = 768 of the two Linears + 32 of the ReLU
DS_MLP_STRINGS = ("800 ", "384 MACs", "212")
DS_TRANSFORMER = (19072, 9216, 2436)  # input_shape=(2, 8)
DS_ATTENTION = (21504, 10752, 0)  # scaled_dot_product_attention, q (2,4,8,16), k (2,4,6,16), v (2,4,6,12)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.view(x.shape[0], 2, 4).repeat(1, 1, 2))
        return self.out(self.layer(h)).mean(1)


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v)


def test_get_model_profile_macs_and_params_equal_deepspeeds() -> None:
    flops, macs, params = get_model_profile(_mlp(), input_shape=(2, 8), print_profile=False, as_string=False)
    assert (macs, params) == DS_MLP[1:]
    assert flops == DS_MLP[0] - 2 * 16  # the ReLU's one per element: element-wise operations count 0 here
    strings = get_model_profile(_mlp(), input_shape=(2, 8), print_profile=False)
    assert strings == ("768 ", DS_MLP_STRINGS[1], DS_MLP_STRINGS[2])

    flops, macs, params = get_model_profile(_Transformer(), input_shape=(2, 8), print_profile=False, as_string=False)
    assert (macs, params) == DS_TRANSFORMER[1:]  # the attention counted from its shapes on the CPU kernel too
    assert flops == 2 * macs < DS_TRANSFORMER[0]

    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 12)
    got = get_model_profile(_Attention(), args=[q, k], kwargs={"v": v}, print_profile=False, as_string=False)
    assert got == DS_ATTENTION


def test_get_model_profile_writes_deepspeeds_report(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "sub" / "profile.txt"
    get_model_profile(_mlp(), input_shape=(2, 8), warm_up=3, output_file=str(out), module_depth=1, top_modules=2)
    text = out.read_text()
    assert "Profile Summary at step 3:" in text  # DeepSpeed heads it with warm_up
    assert "world size:" not in text  # no engine: DeepSpeed leaves the engine's lines out
    assert "fwd MACs per GPU:" in text and "384 MACs" in text
    assert "depth 0:" in text and "depth 1:" not in text
    detailed = text.split("Detailed Profile per GPU")[1].splitlines()
    assert detailed[4] == "Sequential("  # a parent's profile on a line of its own, as nn.Module's repr puts it
    assert detailed[5].startswith("  212 = 100% Params, 384 MACs = 100% MACs")
    assert detailed[6].startswith("  (0): Linear(144 = 67.92% Params, 256 MACs = 66.67% MACs")


def test_flops_profiler_counts_between_start_and_stop() -> None:
    model = _mlp()
    x = torch.randn(2, 8)
    prof = FlopsProfiler(model)
    model(x)  # not started: nothing counted, nothing printed
    prof.print_model_profile()
    prof.start_profile()
    model(x)
    assert prof.get_total_flops() == 768 and prof.get_total_macs(as_string=True) == "384 MACs"
    model(x)  # forwards add up until stop_profile
    prof.stop_profile()
    model(x)
    assert prof.get_total_flops() == 2 * 768 and prof.get_total_params() == 212
    duration = prof.get_total_duration()
    assert isinstance(duration, float) and duration > 0
    assert str(prof.get_total_duration(as_string=True)).endswith("s")
    prof.reset_profile()
    assert prof.get_total_flops() == 0 and prof.get_total_params() == 212
    prof.start_profile(ignore_list=[nn.ReLU, nn.Linear])  # ignored modules count only their children
    model(x)
    profile = prof._recording.profile()
    assert profile.total.flops == 768 and profile.modules["0"].flops == 0 and profile.modules["0"].duration == 0
    prof.end_profile()
    assert not prof.started and prof.get_total_flops() == 0
    assert not model._forward_hooks and not model[0]._forward_pre_hooks  # every hook removed


def test_flops_profiler_with_an_engine_prints_its_sizes(tmp_path: pathlib.Path) -> None:
    class _Engine:  # the attributes DeepSpeed's profiler reads from its ds_engine
        world_size, dp_world_size, mp_world_size = 4, 2, 2

        def train_micro_batch_size_per_gpu(self) -> int:
            return 3

    model = _mlp()
    prof = FlopsProfiler(model, ds_engine=_Engine())
    prof.start_profile()
    model(torch.randn(2, 8))
    prof.print_model_profile(profile_step=7, detailed=False, output_file=str(tmp_path / "p.txt"))
    prof.end_profile()
    lines = dict(line.rsplit(":  ", 1) for line in (tmp_path / "p.txt").read_text().splitlines() if ":  " in line)
    assert {k: lines[k].strip() for k in ("world size", "data parallel size", "model parallel size")} == {
        "world size": "4",
        "data parallel size": "2",
        "model parallel size": "2",
    }
    assert lines["batch size per GPU"].strip() == "3"
    assert lines["params of model = params per GPU * mp_size"].strip() == "424"
    assert "Detailed Profile" not in (tmp_path / "p.txt").read_text()
    assert (prof.flops, prof.macs, prof.params) == (768, 384, 212)


def test_get_model_profile_refuses_what_deepspeed_asserts() -> None:
    with pytest.raises(ValueError, match="input_shape, or args"):
        get_model_profile(_mlp())
    with pytest.raises(ValueError, match="non-empty tuple"):
        get_model_profile(_mlp(), input_shape=[2, 8])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch.nn.Module"):
        get_model_profile(lambda x: x, input_shape=(2, 8))  # type: ignore[arg-type]


def test_deepspeed_import_path() -> None:
    import zeroshard as deepspeed

    assert deepspeed.profiling.flops_profiler.get_model_profile is get_model_profile
    from zeroshard.profiling.flops_profiler.profiler import FlopsProfiler as Same

    assert Same is FlopsProfiler
