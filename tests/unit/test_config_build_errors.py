"""Rules about what zeroshard can build run in resolve_config, the path `zeroshard validate-config` and
`initialize` share: offload placement by stage, and optimizer/scheduler params judged by their real
constructors. Each error is one line that names the key; a key DeepSpeed ignores (offload_param below
stage 3) is one warning line, the same from both."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

from helpers.config_checks import warnings_of
from zeroshard.cli.main import main
from zeroshard.config import parse_config, resolve_config
from zeroshard.errors import ConfigError


def _optimizer(type_name: str = "AdamW", **params: Any) -> dict[str, Any]:
    return {"train_batch_size": 2, "optimizer": {"type": type_name, "params": {"lr": 1e-3, **params}}}


def _scheduler(**params: Any) -> dict[str, Any]:
    return {**_optimizer(), "scheduler": {"type": "WarmupLR", "params": params}}


CASES: list[tuple[str, dict[str, Any], str]] = [
    ("lr-string", _optimizer(lr="fast"), 'optimizer.params.lr: "fast" is not a number'),
    ("lr-negative", _optimizer(lr=-1), "optimizer.params.lr: -1 is out of range; expected >= 0.0"),
    ("lr-nan", _optimizer(lr=float("nan")), "optimizer.params.lr: NaN is not a finite number"),
    ("betas-one", _optimizer(betas=[0.9]), "optimizer.params.betas: [0.9] is not a list of 2 numbers"),
    ("betas-three", _optimizer(betas=[0.9, 0.99, 0.9]), "optimizer.params.betas: [0.9, 0.99, 0.9] is not a list"),
    ("betas-range", _optimizer(betas=[0.9, 1.0]), "optimizer.params.betas[1]: 1.0 is out of range"),
    ("betas-negative", _optimizer(betas=[-0.1, 0.9]), "optimizer.params.betas[0]: -0.1 is out of range"),
    ("eps", _optimizer(eps="small"), 'optimizer.params.eps: "small" is not a number'),
    ("weight-decay", _optimizer(weight_decay=-0.1), "optimizer.params.weight_decay: -0.1 is out of range"),
    ("amsgrad", _optimizer(amsgrad="yes"), 'optimizer.params.amsgrad: "yes" is not a bool'),
    ("sgd-momentum", _optimizer("SGD", momentum=-1), "optimizer.params.momentum: -1 is out of range"),
    ("lion-betas", _optimizer("Lion", betas=[0.9, 2]), "optimizer.params.betas[1]: 2 is out of range"),
    ("type", _optimizer("Adamm"), "optimizer.type='Adamm' is unknown. Did you mean 'Adam'?"),
    ("params-key", _optimizer(lrr=1e-3), "optimizer.params.lrr is not a parameter of AdamW. Did you mean 'lr'?"),
    ("warmup-steps", _scheduler(warmup_num_steps="ten"), "scheduler.params.warmup_num_steps must be an integer"),
    ("scheduler-key", _scheduler(warmup_steps=10), "scheduler.params.warmup_steps is not a parameter of WarmupLR"),
    (
        "offload-optimizer-stage",
        {"train_batch_size": 2, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
        "zero_optimization.offload_optimizer needs zero_optimization.stage >= 1",
    ),
    (
        "ratio",
        {
            "train_batch_size": 2,
            "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
        },
        "zero_optimization.offload_optimizer.ratio: 0.5 (partial offload) needs zero_optimization.stage 3",
    ),
    (
        "nvme-path-empty",
        {
            "train_batch_size": 2,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ""}},
        },
        'zero_optimization.offload_param.device is "nvme" but offload_param.nvme_path is not set',
    ),
    (
        "grad-norm-clipping",
        {"train_batch_size": 2, "zero_optimization": {"stage": 2, "compute_grad_norm": False}},
        "zero_optimization.compute_grad_norm is false, which needs gradient_clipping 0",
    ),
]
IDS = [name for name, _, _ in CASES]


@pytest.mark.parametrize(("name", "source", "message"), CASES, ids=IDS)
def test_resolve_names_the_key(name: str, source: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_config(parse_config(source), world_size=1)
    text = str(info.value)
    assert message in text and "\n" not in text, text


@pytest.mark.parametrize(("name", "source", "message"), CASES[::3], ids=IDS[::3])
def test_validate_config_gives_the_same_line(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], name: str, source: dict[str, Any], message: str
) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(source))
    assert main(["validate-config", str(path), "--strict"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_valid_optimizer_and_scheduler_still_resolve() -> None:
    cfg = resolve_config(
        parse_config(
            {
                **_optimizer("SGD", momentum=0.9, nesterov=True, weight_decay=0),
                "scheduler": {"type": "StepLR", "params": {"step_size": 10}},
            }
        ),
        world_size=1,
    )
    assert cfg.optimizer is not None and cfg.optimizer.params["momentum"] == 0.9
    resolve_config(parse_config({**_optimizer(betas=[0, 0.5], adam_w_mode=False), "train_batch_size": 2}), world_size=1)


OFFLOAD_PARAM_WARNING = 'zero_optimization.offload_param.device="cpu" is ignored at zero_optimization.stage'


def _offload_param(stage: int) -> dict[str, Any]:
    return {
        **_optimizer("Adam", lr=0.1),
        "zero_optimization": {"stage": stage, "offload_param": {"device": "cpu", "pin_memory": True}},
    }


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage_3_is_ignored_with_one_warning(stage: int, log: pytest.LogCaptureFixture) -> None:
    """DeepSpeed ignores offload_param below stage 3; so do we, saying so once, and training still works."""
    import zeroshard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    before = model.weight.detach().clone()
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=_offload_param(stage)
    )
    warnings = [line for line in warnings_of(log) if "offload_param" in line]
    assert len(warnings) == 1 and f"{OFFLOAD_PARAM_WARNING} {stage}" in warnings[0], warnings
    assert "\n" not in warnings[0]
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    assert engine.was_step_applied() and not torch.equal(before, model.weight)
    assert model.weight.device.type == "cpu" and engine.zero_optimization_stage() == stage
    engine.destroy()


def test_validate_config_shows_the_offload_param_warning(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_offload_param(1)))
    assert main(["validate-config", str(path), "--strict"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if "offload_param" in line and "ignored" in line]
    assert len(lines) == 1 and f"{OFFLOAD_PARAM_WARNING} 1" in lines[0], captured.out
