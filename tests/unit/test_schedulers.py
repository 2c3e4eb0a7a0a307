"""The five DeepSpeed LR schedules: closed-form sequences, DeepSpeed parity, state round trip, config errors.

Each schedule is checked over 50 steps against a formula written out here, independently of the
implementation (relative tolerance 1e-12), and against deepspeed.runtime.lr_schedules (the reference) bit for
bit. Sequences hold the lr after construction followed by the lr after each of 50 step() calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.errors import ConfigError
from zeroshard.optim import build_lr_scheduler

STEPS = 50
BASE_LR = 0.05

# ---------------------------------------------------------------------------------------------------------
# Closed forms. t is the batch iteration (0 after the first step()); each returns (lr, beta1 or None).
# ---------------------------------------------------------------------------------------------------------


def warmup_ramp(t: int, n: int, kind: str) -> float:
    n = max(2, n)
    return math.log(t + 1) / math.log(n) if kind == "log" else t / n


def warmup_lr(t: int, lo: float = 0.0, hi: float = BASE_LR, n: int = 1000, kind: str = "log") -> float:
    if t < 0:
        return lo
    return lo + (hi - lo) * (warmup_ramp(t, n, kind) if t < max(2, n) else 1.0)


def warmup_decay_lr(t: int, total: int, lo: float = 0.0, hi: float = 0.001, n: int = 1000, kind: str = "log") -> float:
    if t < 0:
        return lo
    if t < max(2, n):
        return lo + (hi - lo) * warmup_ramp(t, n, kind)
    return lo + (hi - lo) * max(0.0, (total - t) / max(1, total - max(2, n)))


def warmup_cosine_lr(
    t: int, total: int, min_ratio: float = 0.0, n: int = 1000, cos_min: float = 1e-4, kind: str = "log"
) -> float:
    if t < 0:
        return 0.0
    n = max(2, n)
    if t < n:
        return BASE_LR * (min_ratio + (1 - min_ratio) * warmup_ramp(t, n, kind))
    progress = min(1.0, (t - n + 1) / max(1, total - n))
    return BASE_LR * (cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress)))


def one_cycle(
    t: int,
    lo: float,
    hi: float,
    first: int = 2000,
    second: int | None = None,
    stairs1: int = 0,
    stairs2: int | None = None,
    decay_step: int = 0,
    lr_rate: float = 0.0,
    mom_lo: float = 0.8,
    mom_hi: float = 0.9,
    mom_rate: float = 0.0,
) -> tuple[float, float]:
    second = first if second is None else second
    stairs2 = stairs1 if stairs2 is None else stairs2
    total = first + second
    if t < 0:
        return lo, mom_lo
    if t < total:
        pos = t + 1
        if pos <= first:
            frac = math.floor(pos * stairs1 / first) / stairs1 if stairs1 else pos / first
        else:
            frac = math.floor((total - pos) * stairs2 / second) / stairs2 if stairs2 else (total - pos) / second
        return lo + (hi - lo) * frac, mom_hi - (mom_hi - mom_lo) * frac
    done = t - total + 1
    lr = lo if (decay_step == 0 or lr_rate == 0) else lo / (1 + lr_rate * done / decay_step)
    mom = mom_hi if (decay_step == 0 or mom_rate == 0) else mom_hi * (1 + mom_rate * done / decay_step)
    return lr, mom


def lr_range(t: int, lo: float = 1e-3, size: int = 2000, rate: float = 1.0, staircase: bool = False) -> float:
    if t < 0:
        return lo
    interval = (t + 1) // size if staircase else (t + 1) / size
    return lo * (1 + rate * interval)


def _lr_only(fn: Callable[[int], float]) -> Callable[[int], tuple[float, float | None]]:
    return lambda t: (fn(t), None)


CASES: list[tuple[str, str, dict[str, Any], Callable[[int], tuple[float, float | None]]]] = [
    ("WarmupLR", "defaults", {}, _lr_only(lambda t: warmup_lr(t))),
    (
        "WarmupLR",
        "log",
        {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 20},
        _lr_only(lambda t: warmup_lr(t, 0.001, 0.01, 20, "log")),
    ),
    (
        "WarmupLR",
        "linear",
        {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 20, "warmup_type": "linear"},
        _lr_only(lambda t: warmup_lr(t, 0.001, 0.01, 20, "linear")),
    ),
    (
        "WarmupLR",
        "one_step",
        {"warmup_num_steps": 1, "warmup_type": "linear"},
        _lr_only(lambda t: warmup_lr(t, 0.0, BASE_LR, 1, "linear")),
    ),
    ("WarmupDecayLR", "defaults", {"total_num_steps": 5000}, _lr_only(lambda t: warmup_decay_lr(t, 5000))),
    (
        "WarmupDecayLR",
        "log",
        {"total_num_steps": 40, "warmup_min_lr": 1e-4, "warmup_max_lr": 0.02, "warmup_num_steps": 10},
        _lr_only(lambda t: warmup_decay_lr(t, 40, 1e-4, 0.02, 10, "log")),
    ),
    (
        "WarmupDecayLR",
        "linear",
        {"total_num_steps": 40, "warmup_max_lr": 0.02, "warmup_num_steps": 10, "warmup_type": "linear"},
        _lr_only(lambda t: warmup_decay_lr(t, 40, 0.0, 0.02, 10, "linear")),
    ),
    ("WarmupCosineLR", "defaults", {"total_num_steps": 5000}, _lr_only(lambda t: warmup_cosine_lr(t, 5000))),
    (
        "WarmupCosineLR",
        "log",
        {"total_num_steps": 40, "warmup_min_ratio": 0.1, "warmup_num_steps": 10, "cos_min_ratio": 0.05},
        _lr_only(lambda t: warmup_cosine_lr(t, 40, 0.1, 10, 0.05, "log")),
    ),
    (
        "WarmupCosineLR",
        "linear",
        {"total_num_steps": 30, "warmup_num_steps": 10, "cos_min_ratio": 0.05, "warmup_type": "linear"},
        _lr_only(lambda t: warmup_cosine_lr(t, 30, 0.0, 10, 0.05, "linear")),
    ),
    ("OneCycle", "defaults", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}, lambda t: one_cycle(t, 0.01, 0.1)),
    (
        "OneCycle",
        "decay",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 10,
            "cycle_second_step_size": 15,
            "decay_step_size": 5,
            "decay_lr_rate": 0.1,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
            "decay_mom_rate": 0.01,
        },
        lambda t: one_cycle(t, 0.01, 0.1, 10, 15, decay_step=5, lr_rate=0.1, mom_lo=0.85, mom_hi=0.95, mom_rate=0.01),
    ),
    (
        "OneCycle",
        "stairs",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 12,
            "cycle_second_step_size": 20,
            "cycle_first_stair_count": 3,
            "cycle_second_stair_count": 5,
            "cycle_momentum": False,
        },
        lambda t: (one_cycle(t, 0.01, 0.1, 12, 20, stairs1=3, stairs2=5)[0], None),
    ),
    ("LRRangeTest", "defaults", {}, _lr_only(lambda t: lr_range(t))),
    (
        "LRRangeTest",
        "continuous",
        {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 7, "lr_range_test_step_rate": 2.0},
        _lr_only(lambda t: lr_range(t, 0.01, 7, 2.0)),
    ),
    (
        "LRRangeTest",
        "staircase",
        {
            "lr_range_test_min_lr": 0.01,
            "lr_range_test_step_size": 7,
            "lr_range_test_step_rate": 2.0,
            "lr_range_test_staircase": True,
        },
        _lr_only(lambda t: lr_range(t, 0.01, 7, 2.0, True)),
    ),
]
IDS = [f"{name}-{label}" for name, label, _, _ in CASES]


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.zeros(3, requires_grad=True)], lr=BASE_LR)


def _trace(scheduler: Any, optimizer: torch.optim.Optimizer, steps: int = STEPS) -> list[tuple[Any, Any]]:
    group = optimizer.param_groups[0]
    seq = [(group["lr"], group["betas"])]
    for _ in range(steps):
        scheduler.step()
        seq.append((group["lr"], group["betas"]))
    return seq


@pytest.mark.parametrize(("name", "label", "params", "formula"), CASES, ids=IDS)
def test_sequence_matches_closed_form(
    name: str, label: str, params: dict[str, Any], formula: Callable[[int], tuple[float, float | None]]
) -> None:
    optimizer = _optimizer()
    scheduler = build_lr_scheduler(name, params, optimizer)
    seq = _trace(scheduler, optimizer)
    for t, (lr, betas) in zip(range(-1, STEPS), seq, strict=True):
        want_lr, want_mom = formula(t)
        assert lr == pytest.approx(want_lr, rel=1e-12, abs=1e-15), f"{name} t={t}"
        if want_mom is not None:
            assert betas[0] == pytest.approx(want_mom, rel=1e-12) and betas[1] == 0.99, f"{name} t={t}"
        else:
            assert betas == (0.9, 0.999)
    assert scheduler.get_last_lr() == [seq[-1][0]]


@pytest.mark.parametrize(("name", "label", "params", "formula"), CASES, ids=IDS)
def test_sequence_matches_deepspeed(name: str, label: str, params: dict[str, Any], formula: Any) -> None:
    ds_schedules = import_deepspeed("deepspeed.runtime.lr_schedules")
    ours_opt, ds_opt = _optimizer(), _optimizer()
    ours = _trace(build_lr_scheduler(name, params, ours_opt), ours_opt)
    theirs = _trace(getattr(ds_schedules, name)(ds_opt, **params), ds_opt)
    assert ours == theirs


def test_multiple_groups_and_per_group_lists() -> None:
    opt = torch.optim.SGD(
        [
            {"params": [torch.zeros(1, requires_grad=True)], "lr": 0.1},
            {"params": [torch.zeros(1, requires_grad=True)], "lr": 0.2},
        ],
    )
    sched = build_lr_scheduler(
        "WarmupLR", {"warmup_min_lr": [0.0, 0.01], "warmup_num_steps": 10, "warmup_type": "linear"}, opt
    )
    for _ in range(6):
        sched.step()
    assert sched.get_last_lr() == pytest.approx([0.1 * 5 / 10, 0.01 + (0.2 - 0.01) * 5 / 10])
    assert [g["lr"] for g in opt.param_groups] == sched.get_last_lr()
    # WarmupCosineLR scales each group's own lr.
    cos: Any = build_lr_scheduler("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 4}, opt)
    cos.step()
    assert cos.get_lr() == [0.0, 0.0]  # log warmup at t=0


def test_one_cycle_without_betas_only_cycles_lr() -> None:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5, momentum=0.9)
    sched = build_lr_scheduler("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 4}, opt)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 + 0.9 / 4)
    assert "betas" not in opt.param_groups[0] and opt.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize(("name", "label", "params", "formula"), CASES, ids=IDS)
def test_state_dict_round_trip_resumes(name: str, label: str, params: dict[str, Any], formula: Any) -> None:
    full_opt = _optimizer()
    full = _trace(build_lr_scheduler(name, params, full_opt), full_opt)

    first_opt = _optimizer()
    first = build_lr_scheduler(name, params, first_opt)
    _trace(first, first_opt, steps=20)
    state = first.state_dict()
    resumed_opt = _optimizer()
    resumed_opt.load_state_dict(first_opt.state_dict())
    resumed = build_lr_scheduler(name, params, resumed_opt)
    resumed.load_state_dict(state)
    assert _trace(resumed, resumed_opt, steps=STEPS - 20)[1:] == full[21:]


def test_loads_a_deepspeed_state_dict() -> None:
    opt = _optimizer()
    sched = build_lr_scheduler("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 10}, opt)
    sched.load_state_dict({"last_batch_iteration": 24})
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(warmup_cosine_lr(25, 40, 0.0, 10, 1e-4), rel=1e-12)


def test_last_batch_iteration_param_starts_mid_schedule() -> None:
    opt = _optimizer()
    sched = build_lr_scheduler("LRRangeTest", {"last_batch_iteration": 9, "lr_range_test_step_size": 10}, opt)
    assert opt.param_groups[0]["lr"] == BASE_LR  # not applied until the next step, as in DeepSpeed
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * (1 + 11 / 10))


def test_torch_scheduler_by_name() -> None:
    opt = _optimizer()
    sched = build_lr_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, opt)
    for _ in range(4):
        opt.step()
        sched.step()
    assert sched.get_last_lr() == pytest.approx([BASE_LR / 4])
    assert type(build_lr_scheduler("cosineannealinglr", {"T_max": 10}, _optimizer())).__name__ == ("CosineAnnealingLR")


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "params", "pattern"),
    [
        (
            "WarmupLR",
            {"warmup_num_step": 10},
            r"scheduler\.params\.warmup_num_step .*Did you mean 'warmup_num_steps'",
        ),
        (
            "WarmupCosineLR",
            {"total_num_steps": 10, "warmup_max_lr": 0.1},
            r"scheduler\.params\.warmup_max_lr .*warmup_min_ratio",
        ),
        ("WarmupLR", {"warmup_num_steps": -1}, r"scheduler\.params\.warmup_num_steps .*-1"),
        ("WarmupLR", {"warmup_num_steps": 1.5}, r"scheduler\.params\.warmup_num_steps .*1\.5"),
        ("WarmupLR", {"warmup_type": "cosine"}, r"scheduler\.params\.warmup_type='cosine'"),
        ("WarmupLR", {"warmup_max_lr": "0.1"}, r"scheduler\.params\.warmup_max_lr .*'0\.1'"),
        ("WarmupLR", {"warmup_max_lr": [0.1, 0.2]}, r"scheduler\.params\.warmup_max_lr has 2 values"),
        ("WarmupDecayLR", {"warmup_num_steps": 10}, r"scheduler\.params\.total_num_steps is required"),
        (
            "WarmupDecayLR",
            {"total_num_steps": 5, "warmup_num_steps": 10},
            r"scheduler\.params\.total_num_steps=5 .*warmup_num_steps=10",
        ),
        ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 10}, r"total_num_steps=5"),
        ("OneCycle", {"cycle_max_lr": 0.1}, r"scheduler\.params\.cycle_min_lr is required"),
        (
            "OneCycle",
            {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 0},
            r"scheduler\.params\.cycle_first_step_size .*0",
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_momentum": "yes"},
            r"scheduler\.params\.cycle_momentum",
        ),
        ("LRRangeTest", {"lr_range_test_step_size": 0}, r"scheduler\.params\.lr_range_test_step_size .*0"),
        ("StepLR", {"step_size": 2, "gama": 0.5}, r"scheduler\.params\.gama .*Did you mean 'gamma'"),
        ("ReduceLROnPlateau", {}, r"scheduler\.type='ReduceLROnPlateau' is not supported"),
    ],
)
def test_config_errors(name: str, params: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        build_lr_scheduler(name, params, _optimizer())


def test_unknown_type_suggests() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.type='WarmupCosine' is unknown\. Did you mean 'WarmupCosineLR'"):
        build_lr_scheduler("WarmupCosine", {}, _optimizer())


def test_zero_warmup_steps_is_accepted_as_two() -> None:
    opt = _optimizer()
    sched = build_lr_scheduler("WarmupLR", {"warmup_num_steps": 0, "warmup_type": "linear"}, opt)
    assert [lr for lr, _ in _trace(sched, opt, steps=3)] == pytest.approx([0.0, 0.0, BASE_LR / 2, BASE_LR])


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10}),
        ("WarmupDecayLR", {"warmup_num_steps": 3, "total_num_steps": 20, "warmup_max_lr": 0.01}),
        ("WarmupCosineLR", {"warmup_num_steps": 3, "total_num_steps": 20}),
        ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 4}),
    ],
)
def test_a_restored_schedule_writes_its_lr_into_a_fresh_optimizer(name: str, params: dict[str, Any]) -> None:
    """A load without the optimizer's state (`load_optimizer_states=False`) took its first step at the fresh
    optimizer's lr (WarmupLR's 0) and `get_last_lr()` said so; now the restored iteration's lr (and OneCycle's betas)
    are in the groups, as they were when saved."""

    def fresh() -> tuple[torch.optim.Optimizer, Any]:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
        return optimizer, build_lr_scheduler(name, params, optimizer)

    optimizer, scheduler = fresh()
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    saved = scheduler.state_dict()
    again, restored = fresh()
    restored.load_state_dict(saved)
    assert again.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] > 0
    assert again.param_groups[0]["betas"] == optimizer.param_groups[0]["betas"]
    assert restored.get_last_lr() == scheduler.get_last_lr()
