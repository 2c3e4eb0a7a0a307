"""Progressive Layer Dropping ([Note: progressive layer drop]) and the legacy curriculum ([Note: legacy curriculum
learning]): both removed in DeepSpeed 0.19, kept here. The PLD tests are DeepSpeed's own (tests/unit/runtime/
test_pld.py of 0.18: the schedule, theta after each step of an engine, a TypeError for a module without the
keywords); the curriculum's schedules are checked against DeepSpeed 0.19.8's CurriculumScheduler (still used by its
data sampler) where DeepSpeed is installed, and its engine behaviour against the legacy engine's rules."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from zeroshard.config import parse_config
from zeroshard.errors import ConfigError, ZeroshardError
from zeroshard.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from zeroshard.runtime.progressive_layer_drop import ProgressiveLayerDrop

GAMMA = 0.001


def _theta(theta: float, step: int) -> float:
    return (1.0 - theta) * math.exp(-GAMMA * step) + theta


@pytest.mark.parametrize("theta", [0, 0.1, 0.9, 1.0])
def test_pld_schedule(theta: float) -> None:
    np = pytest.importorskip("numpy")
    pld = ProgressiveLayerDrop(theta, GAMMA)
    assert pld.get_theta() == 1.0
    for i in range(60):  # (math.exp was 1 ulp off numpy's at steps 10, 26, 45, 51)
        pld.update_state(i)
        assert pld.get_theta() == (1.0 - theta) * np.exp(-GAMMA * i) + theta  # DeepSpeed's test: exact
        assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": pld.get_theta()}


class _Recorder(nn.Module):
    """Records the keyword arguments of each forward; `strict` takes none (a model unaware of the schedules)."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.seen: list[dict[str, Any]] = []
        self.strict = strict

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.strict and kwargs:
            raise TypeError(f"forward() got unexpected keyword arguments {sorted(kwargs)}")
        self.seen.append(kwargs)
        return self.linear(x).pow(2).mean()


def _engine(extra: dict[str, Any], gas: int = 1, strict: bool = False) -> Any:
    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        **extra,
    }
    model = _Recorder(strict)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


@pytest.mark.parametrize("theta", [0, 0.1, 0.9, 1.0])
def test_pld_engine_passes_theta_to_training_forwards_and_moves_it_each_step(theta: float) -> None:
    engine = _engine({"progressive_layer_drop": {"enabled": True, "theta": theta, "gamma": GAMMA}}, gas=2)
    model = engine.module
    for i in range(6):  # three steps of two micro-steps
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
        if i % 2 == 1:  # a boundary: after step k (from 0), theta(k)
            assert engine.get_pld_theta() == _theta(theta, i // 2)
    thetas = [kwargs["pld_theta"] for kwargs in model.seen]
    assert all(kwargs["progressive_layer_drop"] is True for kwargs in model.seen)
    assert thetas == [1.0, 1.0, _theta(theta, 0), _theta(theta, 0), _theta(theta, 1), _theta(theta, 1)]
    model.eval()
    engine(torch.randn(2, 4))
    assert model.seen[-1] == {}  # evaluation forwards get nothing
    engine.destroy()


def test_pld_off_passes_nothing_and_a_module_without_the_keywords_fails_as_under_deepspeed() -> None:
    engine = _engine({})
    assert engine.get_pld_theta() is None and engine.progressive_layer_drop is None
    engine(torch.randn(2, 4))
    assert engine.module.seen == [{}]
    engine.destroy()
    strict = _engine({"progressive_layer_drop": {"enabled": True}}, strict=True)
    with pytest.raises(TypeError):
        strict(torch.randn(2, 4))
    strict.destroy()


LINEAR = {
    "min_difficulty": 8,
    "max_difficulty": 64,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 40, "difficulty_step": 8},
}
SCHEDULES = [
    LINEAR,
    {**LINEAR, "min_difficulty": 8, "schedule_config": {"total_curriculum_step": 40, "difficulty_step": 16}},
    {
        "min_difficulty": 16,
        "max_difficulty": 512,
        "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 16, "root_degree": 2},
    },
    {
        "min_difficulty": 1,
        "max_difficulty": 3,
        "schedule_type": "fixed_discrete",
        "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]},
    },
]


@pytest.mark.parametrize("config", SCHEDULES, ids=lambda c: f"{c['schedule_type']}-{c['min_difficulty']}")
def test_curriculum_schedules_equal_deepspeeds(config: dict[str, Any]) -> None:
    reference = pytest.importorskip("deepspeed.runtime.data_pipeline.curriculum_scheduler").CurriculumScheduler
    ours, theirs = CurriculumScheduler(config), reference(config)
    for step in range(0, 130):
        assert ours.get_difficulty(step) == theirs.get_difficulty(step), step
        assert ours.update_difficulty(step) == theirs.update_difficulty(step), step


def test_curriculum_schedules_by_hand() -> None:
    linear = CurriculumScheduler(LINEAR)
    assert [linear.get_difficulty(s) for s in (0, 1, 10, 20, 39, 40, 80)] == [8, 8, 16, 32, 56, 64, 64]
    coarse = CurriculumScheduler({**LINEAR, "schedule_config": {"total_curriculum_step": 40, "difficulty_step": 16}})
    assert coarse.get_difficulty(0) == 16  # never 0: the first multiple of the step at or above min_difficulty
    discrete = CurriculumScheduler(SCHEDULES[3])
    assert [discrete.get_difficulty(s) for s in (0, 5, 6, 10, 11)] == [1, 1, 2, 2, 3]
    custom = CurriculumScheduler({"min_difficulty": 4, "max_difficulty": 100, "schedule_type": "custom"})
    with pytest.raises(ZeroshardError, match="set_custom_get_difficulty"):
        custom.update_difficulty(1)
    custom.set_custom_get_difficulty(lambda step: 4 + step)
    assert custom.update_difficulty(7) == 11 and custom.get_current_difficulty() == 11


def test_curriculum_engine_passes_the_next_steps_seqlen_to_training_forwards() -> None:
    fast = {**LINEAR, "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}}
    engine = _engine({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", **fast}}, gas=2)
    assert engine.curriculum_enabled_legacy() and engine.curriculum_params_legacy()["max_difficulty"] == 64
    for _ in range(6):
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
    seqlens = [kwargs["curriculum_seqlen"] for kwargs in engine.module.seen]
    # window k (steps taken: k) trains toward step k + 1: difficulty(k + 1), the same for both micro-steps
    assert seqlens == [CurriculumScheduler(fast).get_difficulty(k // 2 + 1) for k in range(6)]
    assert seqlens == [16, 16, 32, 32, 48, 48]
    assert engine.curriculum_scheduler_legacy.get_current_difficulty() == 48
    engine.module.eval()
    engine(torch.randn(2, 4))
    assert engine.module.seen[-1] == {}
    engine.destroy()
    other = _engine({"curriculum_learning": {"enabled": True, "curriculum_type": "vocab", **LINEAR}})
    other(torch.randn(2, 4))
    assert other.module.seen == [{}] and other.curriculum_scheduler_legacy.get_current_difficulty() == 8
    other.destroy()
    off = _engine({})
    assert off.curriculum_enabled_legacy() is False and off.curriculum_params_legacy() is False
    off.destroy()


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"progressive_layer_drop": {"enabled": True, "theta": 1.5}}, "progressive_layer_drop.theta"),
        ({"progressive_layer_drop": {"enabled": True, "gama": 0.1}}, "gamma"),
        ({"curriculum_learning": {"enabled": True, "max_difficulty": 8}}, "curriculum_learning.min_difficulty"),
        (
            {"curriculum_learning": {**LINEAR, "enabled": True, "schedule_type": "fixed_root"}},
            "schedule_config.root_degree",
        ),
        (
            {"curriculum_learning": {**LINEAR, "enabled": True, "schedule_config": {"total_step": 10}}},
            "schedule_config.total_step: unknown key",
        ),
        (
            {"curriculum_learning": {**SCHEDULES[3], "enabled": True, "schedule_config": {"difficulty": [1, 2]}}},
            "schedule_config.max_step",
        ),
        (
            {
                "curriculum_learning": {
                    **SCHEDULES[3],
                    "enabled": True,
                    "schedule_config": {"difficulty": [1, 2], "max_step": [5, 10]},
                }
            },
            "one entry more than max_step",
        ),
        ({"curriculum_learning": {**LINEAR, "enabled": True, "schedule_type": "fixed_log"}}, "fixed_log"),
        ({"curriculum_learning": {**LINEAR, "enabled": True, "min_difficulty": 128}}, "above max_difficulty"),
    ],
)
def test_bad_schedule_blocks_fail_at_parse_time_naming_the_key(block: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as failure:
        parse_config({"train_batch_size": 2, **block})
    assert "\n" not in str(failure.value)


def test_a_disabled_curriculum_block_needs_nothing_else() -> None:
    parse_config({"train_batch_size": 2, "curriculum_learning": {"enabled": False}})
