"""`zero_optimization.parameter_alignment` (DeepSpeed's stage 1-2 knob): every parameter of the flat buffers starts on
a 16-byte boundary; the updates are the same to the bit (padding only), and the key is ignored, with one line, at
stages 0 and 3 as DeepSpeed ignores it there."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from helpers.config_checks import log, warnings_of  # noqa: F401  # `log` is a fixture
from helpers.harness import run_on_ranks

CASES = [(1, "fp32", 1), (2, "fp32", 2), (2, "bf16", 1)]  # stage, dtype, gradient accumulation


def _model() -> nn.Module:
    torch.manual_seed(0)  # sizes that are not multiples of 16 bytes: 7 x 5 weights, 5- and 3-element biases
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))


def _train(
    rank: int, world_size: int, stage: int, dtype: str, gas: int, aligned: bool, save: str = "", load: str = ""
) -> Any:
    """3 steps (`save`: save after the first and go on; `load`: load that checkpoint and take the last 2)."""
    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage, "parameter_alignment": aligned},
        "bf16": {"enabled": dtype == "bf16"},
    }
    engine, *_ = zeroshard.initialize(model=_model(), config=config)
    size = 2 if dtype == "bf16" else 4
    offsets = [(s.offset * size, s.numel) for g in engine.strategy.layout.groups for s in g.slots]
    generator = torch.Generator().manual_seed(1 + rank)
    losses = []
    if load:
        engine.load_checkpoint(load, tag="t")
    for micro in range(3 * gas):
        x = torch.randn(2, 7, generator=generator).to(engine.device, torch.bfloat16 if dtype == "bf16" else None)
        if load and micro < gas:
            continue  # the checkpoint's step
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if save and micro == gas - 1:
            engine.save_checkpoint(save, tag="t")
    params = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    engine.destroy()
    return losses, params, offsets


def _runs(rank: int, world_size: int, root: str) -> list[Any]:
    out = [(_train(rank, world_size, *c, False), _train(rank, world_size, *c, True)) for c in CASES]
    # a checkpoint names parameter ranges: saved aligned, it resumes unaligned (and the other way) to the bit
    through = _train(rank, world_size, 2, "fp32", 1, True, save=f"{root}/aligned")
    resumed = _train(rank, world_size, 2, "fp32", 1, False, load=f"{root}/aligned")
    back = _train(rank, world_size, 2, "fp32", 1, True, load=f"{root}/aligned")
    return [*out, (through, resumed, back)]


def test_every_parameter_starts_on_16_bytes_and_training_is_unchanged(tmp_path) -> None:
    for *per_case, (through, resumed, back) in run_on_ranks(_runs, 2, str(tmp_path), timeout=600):
        assert resumed[0] == back[0] == through[0][1:] and resumed[1].equal(through[1]) and back[1].equal(through[1])
        for case, (plain, aligned) in zip(CASES, per_case, strict=True):
            assert aligned[0] == plain[0] and aligned[1].equal(plain[1]), case
            assert all(byte % 16 == 0 for byte, _ in aligned[2]), (case, aligned[2])
            assert any(byte % 16 for byte, _ in plain[2]), (case, plain[2])  # without the key they are packed


@pytest.mark.parametrize("stage", [0, 3])
def test_ignored_with_one_line_where_deepspeed_ignores_it(stage: int, log: pytest.LogCaptureFixture) -> None:  # noqa: F811
    from zeroshard.config import parse_config

    parse_config({"train_batch_size": 2, "zero_optimization": {"stage": stage, "parameter_alignment": True}})
    assert [line for line in warnings_of(log) if "parameter_alignment" in line] == [
        f"zeroshard: zero_optimization.parameter_alignment is ignored at zero_optimization.stage {stage}, as "
        "DeepSpeed ignores it: it aligns the parameters of stage 1-2 flat buffers"
    ]
