"""fp16 loss scaler: DeepSpeed's update rule, hysteresis, the min-scale error, state round trip, parity."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.errors import ConfigError, LossScaleError
from zeroshard.precision import DynamicLossScaler, StaticLossScaler, build_loss_scaler, has_inf_or_nan
from zeroshard.precision.loss_scaler import Fp16OptimizerLossScaler


def _dynamic(**overrides: Any) -> DynamicLossScaler:
    args: dict[str, Any] = {
        "init_scale": 2.0**16,
        "scale_window": 4,
        "min_scale": 1.0,
        "delayed_shift": 1,
        "consecutive_hysteresis": False,
    }
    args.update(overrides)
    return DynamicLossScaler(**args)


def _run(scaler: DynamicLossScaler, overflows: list[bool]) -> list[float]:
    scales = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        scales.append(scaler.loss_scale)
    return scales


def test_scale_doubles_after_a_window_of_clean_steps() -> None:
    """DeepSpeed counts stable steps as t - last_overflow - 1 and raises when that is a positive multiple of
    the window: the first raise after an overflow (or the start) is on the (window + 1)-th clean step, the
    next ones every `window` clean steps."""
    window = 4
    scaler = _dynamic(scale_window=window)
    base = 2.0**16
    assert _run(scaler, [False] * window) == [base] * window
    assert _run(scaler, [False]) == [2 * base]
    assert _run(scaler, [False] * window) == [2 * base] * (window - 1) + [4 * base]
    assert _run(scaler, [True]) == [2 * base]
    assert _run(scaler, [False] * (window + 1)) == [2 * base] * window + [4 * base]


def test_hysteresis_two_needs_two_overflows_to_halve() -> None:
    scaler = _dynamic(delayed_shift=2, scale_window=100)
    assert _run(scaler, [True]) == [2.0**16]
    assert scaler.hysteresis_left == 1
    # A clean step does not refill the counter without consecutive_hysteresis ...
    assert _run(scaler, [False, True, True]) == [2.0**16, 2.0**15, 2.0**14]
    # ... only a scale raise does.
    scaler = _dynamic(delayed_shift=2, scale_window=2)
    assert _run(scaler, [True, False, False, False]) == [2.0**16, 2.0**16, 2.0**16, 2.0**17]
    assert scaler.hysteresis_left == 2
    assert _run(scaler, [True]) == [2.0**17]


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    scaler = _dynamic(delayed_shift=2, scale_window=100, consecutive_hysteresis=True)
    assert _run(scaler, [True, False, True, False, True]) == [2.0**16] * 5
    assert _run(scaler, [True]) == [2.0**15]  # two in a row


def test_min_scale_clamps_then_raises() -> None:
    scaler = _dynamic(init_scale=8.0, min_scale=2.0, scale_window=1000)
    assert _run(scaler, [True, True]) == [4.0, 2.0]
    with pytest.raises(LossScaleError) as err:
        scaler.update_scale(True)
    message = str(err.value)
    assert "min_loss_scale=2 after 3 consecutive overflows (3 since the scale last grew)" in message
    assert '"bf16": {"enabled": true}' in message and "learning rate" in message and "inf/nan" in message
    assert scaler.loss_scale == 2.0  # state untouched by the failed update


def test_min_scale_waits_for_hysteresis() -> None:
    scaler = _dynamic(init_scale=1.0, min_scale=1.0, delayed_shift=3)
    _run(scaler, [True, True])  # absorbed by hysteresis
    with pytest.raises(LossScaleError, match="after 3 consecutive overflows"):
        scaler.update_scale(True)


def test_non_power_of_two_min_scale_is_clamped() -> None:
    scaler = _dynamic(init_scale=8.0, min_scale=3.0)
    assert _run(scaler, [True, True]) == [4.0, 3.0]


def test_static_scaler_never_changes() -> None:
    scaler = StaticLossScaler(128.0)
    for overflow in [True, False] * 20:
        scaler.update_scale(overflow)
    assert scaler.loss_scale == 128.0 and scaler.dynamic is False
    restored = StaticLossScaler(1.0)
    restored.load_state_dict(scaler.state_dict())
    assert restored.loss_scale == 128.0


def test_state_dict_round_trip_continues_sequence() -> None:
    rng = random.Random(0)
    overflows = [rng.random() < 0.3 for _ in range(200)]
    kwargs = {"delayed_shift": 2, "scale_window": 5, "init_scale": 2.0**20, "min_scale": 2.0**-30}
    full = _run(_dynamic(**kwargs), overflows)
    first = _dynamic(**kwargs)
    _run(first, overflows[:100])
    resumed = _dynamic(**kwargs)
    resumed.load_state_dict(first.state_dict())
    assert _run(resumed, overflows[100:]) == full[100:]


def test_build_loss_scaler() -> None:
    common: dict[str, Any] = {
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    }
    dynamic = build_loss_scaler(loss_scale=0, **common)
    assert dynamic.dynamic and dynamic.loss_scale == 65536.0 and isinstance(dynamic.loss_scale, float)
    static = build_loss_scaler(loss_scale=1024, **common)
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 1024.0


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"loss_scale": -1}, r"fp16\.loss_scale"),
        ({"loss_scale_window": 0}, r"fp16\.loss_scale_window .*0"),
        ({"hysteresis": 0}, r"fp16\.hysteresis .*0"),
        ({"min_loss_scale": 0}, r"fp16\.min_loss_scale .*0"),
        ({"initial_scale_power": 16.5}, r"fp16\.initial_scale_power"),
        ({"consecutive_hysteresis": 1}, r"fp16\.consecutive_hysteresis"),
    ],
)
def test_build_loss_scaler_rejects_invalid_values(overrides: dict[str, Any], pattern: str) -> None:
    args: dict[str, Any] = {
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    }
    args.update(overrides)
    with pytest.raises(ConfigError, match=pattern):
        build_loss_scaler(**args)


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed parity
# ---------------------------------------------------------------------------------------------------------


class _RankZero:
    """Stands in for deepspeed.comm in DeepSpeed's scaler (it logs on rank 0; no process group needed)."""

    @staticmethod
    def get_rank() -> int:
        return 0


# (initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale, p_overflow,
#  whether the 300-step run ends at the minimum scale): runs that ride the scale up and down, runs that die.
PARITY_CASES = [
    (16, 5, 1, False, 1, 0.15, False),
    (16, 5, 2, False, 1, 0.25, True),
    (16, 3, 2, True, 1, 0.3, False),
    (16, 10, 3, False, 0.25, 0.1, False),
    (20, 1, 2, True, 1, 0.4, False),
    (12, 2, 1, False, 2, 0.35, True),
    (24, 7, 3, True, 1, 0.2, False),
    (16, 4, 2, False, 1, 0.2, True),
    (4, 20, 2, False, 1, 0.6, True),
    (4, 3, 1, True, 2, 0.5, True),
]


def _ours(index: int, zero_stage: int) -> Any:
    """zeroshard's dynamic scaler for PARITY_CASES[index] at `zero_stage`."""
    power, window, hysteresis, consecutive, min_scale, _, _ = PARITY_CASES[index]
    return build_loss_scaler(
        loss_scale=0,
        initial_scale_power=power,
        loss_scale_window=window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_loss_scale=min_scale,
        zero_stage=zero_stage,
    )


@pytest.mark.parametrize("index", range(len(PARITY_CASES)))
def test_matches_deepspeed_dynamic_loss_scaler(index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ds_scaler = import_deepspeed("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(ds_scaler, "dist", _RankZero)
    power, window, hysteresis, consecutive, min_scale, p_overflow, dies = PARITY_CASES[index]
    theirs = ds_scaler.DynamicLossScaler(
        init_scale=2**power,
        scale_window=window,
        min_scale=min_scale,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=True,
    )
    ours = _ours(index, zero_stage=1)
    assert isinstance(ours, DynamicLossScaler)
    rng = random.Random(index)
    for step in range(300):
        overflow = rng.random() < p_overflow
        try:
            theirs.update_scale(overflow)
        except Exception:  # DeepSpeed raises a bare Exception at the minimum scale
            with pytest.raises(LossScaleError):
                ours.update_scale(overflow)
            assert dies, f"DeepSpeed stopped at step {step}"
            return
        ours.update_scale(overflow)
        assert ours.loss_scale == theirs.cur_scale, f"step {step}"
        assert ours.hysteresis_left == theirs.cur_hysteresis, f"step {step}"
    assert not dies


@pytest.mark.parametrize("index", range(len(PARITY_CASES)))
def test_stage_0_matches_deepspeeds_fp16_optimizer_rule(index: int) -> None:
    """DeepSpeed's stage-0 fp16 optimizers update their `loss_scale_config` by a rule of their own
    (FP16_Optimizer._update_scale): no hysteresis, floored at min_loss_scale, no error there."""
    config = import_deepspeed("deepspeed.runtime.fp16.loss_scaler")
    fused = import_deepspeed("deepspeed.runtime.fp16.fused_optimizer")
    power, window, hysteresis, consecutive, min_scale, p_overflow, _ = PARITY_CASES[index]
    args = {"init_scale": 2**power, "scale_window": window, "delayed_shift": hysteresis, "min_scale": min_scale}
    theirs = SimpleNamespace(
        verbose=False,
        loss_scale_config=config.LossScaleConfig(
            torch.float16,
            True,
            0,
            {**args, "consecutive_hysteresis": consecutive},
            profile=config.LossScaleProfile.FUSED,
        ),
    )
    ours = _ours(index, zero_stage=0)
    assert isinstance(ours, Fp16OptimizerLossScaler)
    rng = random.Random(index)
    for step in range(300):
        overflow = rng.random() < p_overflow
        fused.FP16_Optimizer._update_scale(theirs, overflow)
        ours.update_scale(overflow)
        assert ours.loss_scale == theirs.loss_scale_config.cur_scale, f"step {step}"
        assert ours.iteration == theirs.loss_scale_config.cur_iter, f"step {step}"
        assert ours.last_overflow_iteration == theirs.loss_scale_config.last_overflow_iter, f"step {step}"


# ---------------------------------------------------------------------------------------------------------
# has_inf_or_nan
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_has_inf_or_nan_detects(dtype: torch.dtype, bad: float) -> None:
    tensors = [torch.randn(100).to(dtype) for _ in range(5)]
    assert not has_inf_or_nan(tensors)
    tensors[3][17] = bad
    assert has_inf_or_nan(tensors)


def test_has_inf_or_nan_edge_cases() -> None:
    assert not has_inf_or_nan([])
    assert not has_inf_or_nan([torch.empty(0), torch.arange(3), torch.full((4,), 65504.0, dtype=torch.float16)])
    assert has_inf_or_nan([torch.zeros(2, 2), torch.tensor([[1.0], [float("nan")]]).t()])
    assert has_inf_or_nan(iter([torch.ones(3), torch.tensor([float("inf")], dtype=torch.float64)]))


def test_has_inf_or_nan_syncs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"norm": 0}
    real = torch._foreach_norm

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["norm"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    assert not has_inf_or_nan([torch.randn(10) for _ in range(500)])
    assert calls["norm"] == 1


def test_a_dynamic_scaler_loads_a_static_scalers_state() -> None:
    """A checkpoint saved with `fp16.loss_scale > 0` resumed with a dynamic scale: the scale and step count come
    over, the rest starts fresh (a KeyError left the engine half-loaded)."""
    static = StaticLossScaler(64.0)
    for overflow in (False, True, False):
        static.update_scale(overflow)
    dynamic = DynamicLossScaler(init_scale=2.0**16, scale_window=2, min_scale=1.0, delayed_shift=2,
                                consecutive_hysteresis=False)  # fmt: skip
    dynamic.load_state_dict(static.state_dict())
    assert (dynamic.loss_scale, dynamic.iteration, dynamic.last_overflow_iteration, dynamic.hysteresis_left) == (
        64.0,
        3,
        -1,
        2,
    )
