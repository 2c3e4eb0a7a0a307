"""Learning-rate schedules from ds_config `scheduler.type` / `scheduler.params`.

The five DeepSpeed schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) are
re-implemented with DeepSpeed 0.19's formulas, parameter names and defaults, and its call convention: the
constructor writes the lr of iteration `last_batch_iteration` (-1: before the first step) into every param
group, each `step()` advances one batch and writes the new lr, and the state is `last_batch_iteration`.
Each schedule's parameters are a frozen dataclass, so one schema documents, defaults and validates them.
Any `torch.optim.lr_scheduler` class is also accepted by name, its params passed as keyword arguments.

Where zeroshard is stricter than DeepSpeed (which warns and carries on): an unknown `warmup_type` and
`total_num_steps < warmup_num_steps` are ConfigErrors. `warmup_num_steps: 0` is accepted (as DeepSpeed
before 0.18 did, and as the Hugging Face "auto" value produces) and, like every value below 2, is raised to 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol, cast

import torch

from zeroshard.errors import ConfigError
from zeroshard.utils.logging import get_logger

LOG_WARMUP = "log"
LINEAR_WARMUP = "linear"

PerGroup = float | Sequence[float]
"""A value for every param group, or one value per group."""


class LRSchedulerLike(Protocol):
    """What the engine needs from a scheduler: ours and torch's both qualify."""

    def step(self) -> None: ...

    def get_last_lr(self) -> list[float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


# ---------------------------------------------------------------------------------------------------------
# Parameter schemas (field names are the ds_config keys; defaults are DeepSpeed's class defaults)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WarmupLRParams:
    """`scheduler.params` of WarmupLR."""

    warmup_min_lr: PerGroup = 0.0
    """lr at iteration 0."""
    warmup_max_lr: PerGroup | None = None
    """lr at the end of warmup and after it; None: each group's lr when the scheduler is built."""
    warmup_num_steps: int = 1000
    """Length of the warmup (values below 2 act as 2)."""
    warmup_type: str = LOG_WARMUP
    """"log": min + (max - min) * ln(t + 1) / ln(n); "linear": min + (max - min) * t / n."""

    def __post_init__(self) -> None:
        _check_per_group("warmup_min_lr", self.warmup_min_lr, minimum=0.0)
        if self.warmup_max_lr is not None:
            _check_per_group("warmup_max_lr", self.warmup_max_lr, minimum=0.0)
        _check_int("warmup_num_steps", self.warmup_num_steps, minimum=0)
        if self.warmup_type not in (LOG_WARMUP, LINEAR_WARMUP):
            raise ConfigError(
                f"scheduler.params.warmup_type={self.warmup_type!r} is invalid; use {LOG_WARMUP!r} or {LINEAR_WARMUP!r}"
            )


@dataclass(frozen=True, kw_only=True)
class WarmupDecayLRParams(WarmupLRParams):
    """`scheduler.params` of WarmupDecayLR: WarmupLR, then a linear decay to 0 at `total_num_steps`."""

    total_num_steps: int
    """Iteration at which the lr reaches 0 (required)."""
    warmup_max_lr: PerGroup | None = 0.001
    """lr at the end of warmup (DeepSpeed's WarmupDecayLR default is 0.001, not the group lr)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int("total_num_steps", self.total_num_steps, minimum=0)
        _check_total_after_warmup(self.total_num_steps, self.warmup_num_steps)


@dataclass(frozen=True, kw_only=True)
class WarmupCosineLRParams:
    """`scheduler.params` of WarmupCosineLR: ratios of each group's lr at the time the scheduler is built."""

    total_num_steps: int
    """Iteration at which the cosine reaches `cos_min_ratio` (required)."""
    warmup_min_ratio: float = 0.0
    """Ratio at iteration 0; warmup goes from it to 1."""
    warmup_num_steps: int = 1000
    """Length of the warmup (values below 2 act as 2)."""
    cos_min_ratio: float = 0.0001
    """Ratio at the end of the cosine and after it."""
    warmup_type: str = LOG_WARMUP
    """"log" or "linear", as for WarmupLR."""

    def __post_init__(self) -> None:
        _check_int("total_num_steps", self.total_num_steps, minimum=0)
        _check_int("warmup_num_steps", self.warmup_num_steps, minimum=0)
        _check_number("warmup_min_ratio", self.warmup_min_ratio, minimum=0.0)
        _check_number("cos_min_ratio", self.cos_min_ratio, minimum=0.0)
        if self.warmup_type not in (LOG_WARMUP, LINEAR_WARMUP):
            raise ConfigError(
                f"scheduler.params.warmup_type={self.warmup_type!r} is invalid; use {LOG_WARMUP!r} or {LINEAR_WARMUP!r}"
            )
        _check_total_after_warmup(self.total_num_steps, self.warmup_num_steps)


@dataclass(frozen=True, kw_only=True)
class OneCycleParams:
    """`scheduler.params` of OneCycle: one triangular lr cycle (momentum mirrored), then an optional decay."""

    cycle_min_lr: PerGroup
    """Lower lr of the cycle (required)."""
    cycle_max_lr: PerGroup
    """Upper lr of the cycle (required)."""
    decay_lr_rate: float = 0.0
    """After the cycle: lr = cycle_min_lr / (1 + decay_lr_rate * t / decay_step_size)."""
    cycle_first_step_size: int = 2000
    """Iterations of the rising half."""
    cycle_second_step_size: int | None = None
    """Iterations of the falling half (None: same as the first)."""
    cycle_first_stair_count: int = 0
    """Stairs in the rising half (0: continuous)."""
    cycle_second_stair_count: int | None = None
    """Stairs in the falling half (None: same as the first)."""
    decay_step_size: int = 0
    """Iterations per decay interval after the cycle (0: no decay)."""
    cycle_momentum: bool = True
    """Cycle betas[0] inversely to the lr (only for optimizers with `betas`; beta2 is set to 0.99)."""
    cycle_min_mom: PerGroup = 0.8
    """Lower beta1 of the cycle."""
    cycle_max_mom: PerGroup = 0.9
    """Upper beta1 of the cycle."""
    decay_mom_rate: float = 0.0
    """After the cycle: beta1 = cycle_max_mom * (1 + decay_mom_rate * t / decay_step_size)."""

    def __post_init__(self) -> None:
        _check_per_group("cycle_min_lr", self.cycle_min_lr, minimum=0.0)
        _check_per_group("cycle_max_lr", self.cycle_max_lr, minimum=0.0)
        _check_number("decay_lr_rate", self.decay_lr_rate)
        _check_int("cycle_first_step_size", self.cycle_first_step_size, minimum=1)
        if self.cycle_second_step_size is not None:
            _check_int("cycle_second_step_size", self.cycle_second_step_size, minimum=0)
        _check_int("cycle_first_stair_count", self.cycle_first_stair_count, minimum=0)
        if self.cycle_second_stair_count is not None:
            _check_int("cycle_second_stair_count", self.cycle_second_stair_count, minimum=0)
        _check_int("decay_step_size", self.decay_step_size, minimum=0)
        _check_bool("cycle_momentum", self.cycle_momentum)
        _check_per_group("cycle_min_mom", self.cycle_min_mom, minimum=0.0)
        _check_per_group("cycle_max_mom", self.cycle_max_mom, minimum=0.0)
        _check_number("decay_mom_rate", self.decay_mom_rate)


@dataclass(frozen=True, kw_only=True)
class LRRangeTestParams:
    """`scheduler.params` of LRRangeTest: lr = min_lr * (1 + step_rate * (t + 1) / step_size)."""

    lr_range_test_min_lr: PerGroup = 1e-3
    """Starting lr."""
    lr_range_test_step_size: int = 2000
    """Iterations per unit of interval."""
    lr_range_test_step_rate: float = 1.0
    """Growth per unit of interval."""
    lr_range_test_staircase: bool = False
    """Floor the interval (grow in stairs) instead of growing every iteration."""

    def __post_init__(self) -> None:
        _check_per_group("lr_range_test_min_lr", self.lr_range_test_min_lr, minimum=0.0)
        _check_int("lr_range_test_step_size", self.lr_range_test_step_size, minimum=1)
        _check_number("lr_range_test_step_rate", self.lr_range_test_step_rate)
        _check_bool("lr_range_test_staircase", self.lr_range_test_staircase)


# ---------------------------------------------------------------------------------------------------------
# Schedulers
# ---------------------------------------------------------------------------------------------------------


class BatchLRScheduler:
    """Base of the DeepSpeed-style schedules: the lr is a pure function of the batch iteration."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = [_as_float(g["lr"]) for g in optimizer.param_groups]

    def _start(self) -> None:
        """Apply the initial values; subclasses call it at the end of their constructor."""
        if self.last_batch_iteration == -1:
            self._apply_initial()

    def _apply_initial(self) -> None:
        """Write the lr before the first step into the optimizer (DeepSpeed: the iteration -1 lr)."""
        self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def lr_at(self, iteration: int) -> list[float]:
        """The lr of every param group at batch `iteration`."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        """The lr of every param group at the current iteration."""
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lrs last written into the optimizer."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to the next batch (or to `last_batch_iteration`) and write its lr into every group."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        """`last_batch_iteration`: all of DeepSpeed's state (so a DeepSpeed dict loads too)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the iteration saved by state_dict(); the next step() continues the sequence."""
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])


class WarmupLR(BatchLRScheduler):
    """Warm the lr from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold it.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> params = WarmupLRParams(warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
        >>> sched = WarmupLR(opt, params)
        >>> for _ in range(6):
        ...     sched.step()
        >>> round(opt.param_groups[0]["lr"], 6)
        0.05
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, params: WarmupLRParams, last_batch_iteration: int = -1
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        groups = len(optimizer.param_groups)
        max_lr = params.warmup_max_lr
        if max_lr is None:
            max_lr = [_as_float(g["lr"]) for g in optimizer.param_groups]
        # [Note: lrs read from the optimizer] A base lr taken from the param groups is saved in state_dict():
        # on resume the groups hold the lr of the saved step, not the configured one.
        self._max_lrs_from_groups = params.warmup_max_lr is None
        self.min_lrs = _per_group("warmup_min_lr", params.warmup_min_lr, groups)
        self._set_max_lrs(_per_group("warmup_max_lr", max_lr, groups))
        self.warmup_num_steps = max(2, params.warmup_num_steps)
        self.warmup_type = params.warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._start()

    def _set_max_lrs(self, max_lrs: list[float]) -> None:
        self.max_lrs = max_lrs
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        """last_batch_iteration, plus the max lrs when they were read from the optimizer."""
        state = super().state_dict()
        if self._max_lrs_from_groups:
            state["max_lrs"] = list(self.max_lrs)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self._max_lrs_from_groups and "max_lrs" in state_dict:
            self._set_max_lrs([float(lr) for lr in state_dict["max_lrs"]])

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]

    def _gamma(self, iteration: int) -> float:
        """Fraction of (max - min) added to min at `iteration`."""
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps, self.inverse_log_warm_up)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay from warmup_max_lr to 0 at total_num_steps."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, params: WarmupDecayLRParams, last_batch_iteration: int = -1
    ) -> None:
        self.total_num_steps = params.total_num_steps
        super().__init__(optimizer, params, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps, self.inverse_log_warm_up)
        remaining = float(self.total_num_steps - iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(BatchLRScheduler):
    """Scale each group's lr by a ratio warmed up from warmup_min_ratio to 1, then annealed to cos_min_ratio.

    The lr is 0 before the first step (DeepSpeed's iteration -1 ratio).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, params: WarmupCosineLRParams, last_batch_iteration: int = -1
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = params.total_num_steps
        self.warmup_min_ratio = params.warmup_min_ratio
        self.cos_min_ratio = params.cos_min_ratio
        self.warmup_type = params.warmup_type
        self.warmup_num_steps = max(2, params.warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [_as_float(g["lr"]) for g in optimizer.param_groups]
        self._start()

    def state_dict(self) -> dict[str, Any]:
        """last_batch_iteration and the groups' original lrs (see [Note: lrs read from the optimizer])."""
        return {**super().state_dict(), "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "org_lrs" in state_dict:
            self.org_lrs = [float(lr) for lr in state_dict["org_lrs"]]

    def lr_ratio(self, iteration: int) -> float:
        """The multiplier of the groups' original lr at `iteration`."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            fraction = _warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps, self.inverse_log_warm_up)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        progress = min(
            1.0,
            (iteration - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps),
        )
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.lr_ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(BatchLRScheduler):
    """The 1cycle policy (Smith 2018): lr rises then falls over one cycle, then optionally decays.

    With cycle_momentum and an optimizer that has `betas`, beta1 moves opposite to the lr and beta2 is set to
    0.99, exactly as DeepSpeed does. Before the first step the groups get cycle_min_lr and cycle_min_mom.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, params: OneCycleParams, last_batch_iteration: int = -1
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        groups = len(optimizer.param_groups)
        self.first_step_size = float(params.cycle_first_step_size)
        second = params.cycle_second_step_size
        self.second_step_size = self.first_step_size if second is None else float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = params.cycle_first_stair_count
        second_stairs = params.cycle_second_stair_count
        self.second_stair_count = self.first_stair_count if second_stairs is None else second_stairs
        self.decay_step_size = params.decay_step_size
        self.min_lrs = _per_group("cycle_min_lr", params.cycle_min_lr, groups)
        self.max_lrs = _per_group("cycle_max_lr", params.cycle_max_lr, groups)
        self.decay_lr_rate = params.decay_lr_rate
        self.decay_mom_rate = params.decay_mom_rate
        self.skip_lr_decay = math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        self.cycle_momentum = params.cycle_momentum and self._has_betas()
        self.min_moms = _per_group("cycle_min_mom", params.cycle_min_mom, groups)
        self.max_moms = _per_group("cycle_max_mom", params.cycle_max_mom, groups)
        self._start()

    def _has_betas(self) -> bool:
        """Whether the optimizer has Adam-style betas to cycle (DeepSpeed cycles nothing else)."""
        if "betas" in self.optimizer.defaults:
            return True
        get_logger(__name__).warning(
            "OneCycle: cycle_momentum is ignored because %s has no 'betas'", type(self.optimizer).__name__
        )
        return False

    def _apply_initial(self) -> None:
        self._last_lr = _write_lrs(self.optimizer, self.min_lrs)
        if self.cycle_momentum:
            _write_betas(self.optimizer, self.min_moms)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one batch, writing the lr and (with cycle_momentum) beta1 into every group."""
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            _write_betas(self.optimizer, self.mom_at(self.last_batch_iteration))

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale_factor(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (self._decay_iteration(iteration) / self.decay_step_size)
        return [low / factor for low in self.min_lrs]

    def mom_at(self, iteration: int) -> list[float]:
        """beta1 of every param group at batch `iteration`."""
        if iteration < self.total_size:
            scale = self._scale_factor(iteration)
            return [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms, strict=True)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * (self._decay_iteration(iteration) / self.decay_step_size)
        return [high * factor for high in self.max_moms]

    def _decay_iteration(self, iteration: int) -> float:
        """Iterations since the cycle ended, counting the first post-cycle batch as 1."""
        return iteration - self.total_size + 1

    def _scale_factor(self, iteration: int) -> float:
        """Position within the cycle as a fraction of the amplitude (0 at the ends, 1 at the peak)."""
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale = x / self.step_ratio
            stairs = self.first_stair_count
        else:
            scale = (x - 1) / (self.step_ratio - 1)
            stairs = self.second_stair_count
        if stairs > 0:
            # Quantise from the integer batch offset: a float scale can land just under an exact stair.
            position = batch % self.total_size
            if position <= self.first_step_size:
                stair = position * stairs / self.first_step_size
            else:
                stair = (self.total_size - position) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale


class LRRangeTest(BatchLRScheduler):
    """Grow the lr from lr_range_test_min_lr linearly (or in stairs) to find the largest stable lr."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, params: LRRangeTestParams, last_batch_iteration: int = -1
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group("lr_range_test_min_lr", params.lr_range_test_min_lr, len(optimizer.param_groups))
        self.step_size = params.lr_range_test_step_size
        self.step_rate = params.lr_range_test_step_rate
        self.staircase = params.lr_range_test_staircase
        self._start()

    def _apply_initial(self) -> None:
        self._last_lr = _write_lrs(self.optimizer, self.min_lrs)

    def lr_at(self, iteration: int) -> list[float]:
        interval: float = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [low * increase for low in self.min_lrs]


# ---------------------------------------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------------------------------------

_ScheduleFactory = Callable[[torch.optim.Optimizer, Any, int], BatchLRScheduler]

_SCHEDULES: Mapping[str, tuple[_ScheduleFactory, type[Any]]] = MappingProxyType(
    {
        "WarmupLR": (WarmupLR, WarmupLRParams),
        "WarmupDecayLR": (WarmupDecayLR, WarmupDecayLRParams),
        "WarmupCosineLR": (WarmupCosineLR, WarmupCosineLRParams),
        "OneCycle": (OneCycle, OneCycleParams),
        "LRRangeTest": (LRRangeTest, LRRangeTestParams),
    }
)

# torch schedulers the engine cannot drive from a JSON config, with the reason.
_TORCH_UNSUITABLE: Mapping[str, str] = MappingProxyType(
    {
        "LRScheduler": "it is the abstract base class",
        "ReduceLROnPlateau": "it needs a validation metric at every step",
        "LambdaLR": "it needs a Python callable",
        "MultiplicativeLR": "it needs a Python callable",
        "SequentialLR": "it needs scheduler objects",
        "ChainedScheduler": "it needs scheduler objects",
    }
)


def build_lr_scheduler(type_name: str, params: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> LRSchedulerLike:
    """Build ds_config `scheduler.type` with `scheduler.params` over `optimizer` and apply its initial lr.

    Example:
        >>> import torch
        >>> opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
        >>> sched = build_lr_scheduler("WarmupDecayLR", {"total_num_steps": 100, "warmup_num_steps": 10}, opt)
        >>> sched.step()
        >>> opt.param_groups[0]["lr"]
        0.0
    """
    kwargs = dict(params or {})
    name = _resolve_name(type_name)
    if name in _SCHEDULES:
        return _build_deepspeed_schedule(name, kwargs, optimizer)
    return _build_torch_schedule(name, kwargs, optimizer)


def supported_scheduler_names() -> list[str]:
    """The DeepSpeed schedule names, then the torch.optim.lr_scheduler classes accepted by name."""
    return [*_SCHEDULES, *_torch_scheduler_names()]


def _torch_scheduler_names() -> list[str]:
    """torch.optim.lr_scheduler classes usable from a config."""
    module = torch.optim.lr_scheduler
    return sorted(
        name
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and name not in _TORCH_UNSUITABLE
        and issubclass(obj, module.LRScheduler)
        and not name.startswith("_")
    )


def _resolve_name(type_name: str) -> str:
    """The canonical schedule name (exact, then case-insensitive) or a ConfigError with a suggestion."""
    if type_name in _TORCH_UNSUITABLE:
        raise ConfigError(
            f"scheduler.type={type_name!r} is not supported: {_TORCH_UNSUITABLE[type_name]}. "
            f"Supported: {', '.join(supported_scheduler_names())}."
        )
    names = supported_scheduler_names()
    if type_name in names:
        return type_name
    by_lower = {name.lower(): name for name in names}
    if type_name.lower() in by_lower:
        return by_lower[type_name.lower()]
    close = difflib.get_close_matches(type_name, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"scheduler.type={type_name!r} is unknown.{hint} Supported: {', '.join(names)}.")


def _build_deepspeed_schedule(name: str, kwargs: dict[str, Any], optimizer: torch.optim.Optimizer) -> BatchLRScheduler:
    """One of the five DeepSpeed schedules, its params validated against its schema."""
    scheduler_cls, params_cls = _SCHEDULES[name]
    last_batch_iteration = kwargs.pop("last_batch_iteration", -1)
    _check_int("last_batch_iteration", last_batch_iteration, minimum=-1)
    fields = {f.name: f for f in dataclasses.fields(params_cls)}
    _check_param_names(name, kwargs, list(fields))
    missing = [
        f.name
        for f in fields.values()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in kwargs
    ]
    if missing:
        raise ConfigError(f"scheduler.params.{missing[0]} is required by {name}")
    return scheduler_cls(optimizer, params_cls(**kwargs), last_batch_iteration)


def _check_param_names(name: str, kwargs: Mapping[str, Any], accepted: list[str]) -> None:
    """ConfigError naming the first key the schedule does not take."""
    for key in kwargs:
        if key in accepted:
            continue
        if name == "WarmupCosineLR" and key in ("warmup_min_lr", "warmup_max_lr"):
            hint = " WarmupCosineLR scales each group's lr by a ratio: use warmup_min_ratio / cos_min_ratio."
        else:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"scheduler.params.{key} is not a parameter of {name}.{hint} Accepted: {', '.join(accepted)}."
        )


def _build_torch_schedule(name: str, kwargs: dict[str, Any], optimizer: torch.optim.Optimizer) -> LRSchedulerLike:
    """A torch.optim.lr_scheduler class by name, params passed as keyword arguments."""
    cls = getattr(torch.optim.lr_scheduler, name)
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "optimizer")]
    _check_param_names(name, kwargs, accepted)
    try:
        return cast(LRSchedulerLike, cls(optimizer, **kwargs))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"scheduler.params is invalid for scheduler.type={name!r}: {err}") from err


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


def _warmup_fraction(warmup_type: str, iteration: int, num_steps: int, inverse_log: float) -> float:
    """Fraction of the warmup done at `iteration` (< num_steps), with DeepSpeed's exact arithmetic."""
    if warmup_type == LOG_WARMUP:
        return inverse_log * math.log(iteration + 1)
    return iteration / num_steps


def _write_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> list[float]:
    """Write one lr per group (in place when a group holds its lr as a tensor); return the lrs written."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [_as_float(group["lr"]) for group in optimizer.param_groups]


def _write_betas(optimizer: torch.optim.Optimizer, beta1s: Sequence[float]) -> None:
    """Set each group's betas to (beta1, 0.99): DeepSpeed's OneCycle pins beta2 at 0.99."""
    for group, beta1 in zip(optimizer.param_groups, beta1s, strict=True):
        group["betas"] = (beta1, 0.99)


def _as_float(value: Any) -> float:
    """An lr held as a float or a one-element tensor, as a float."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _per_group(key: str, value: PerGroup, groups: int) -> list[float]:
    """A scalar broadcast to every param group, or a per-group list checked for length."""
    if isinstance(value, Sequence):
        if len(value) != groups:
            raise ConfigError(
                f"scheduler.params.{key} has {len(value)} values but the optimizer has {groups} param groups"
            )
        return [float(v) for v in value]
    return [float(value)] * groups


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_number(key: str, value: Any, minimum: float | None = None) -> None:
    if not _is_number(value) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"scheduler.params.{key} must be a finite number{bound}, got {value!r}")


def _check_per_group(key: str, value: Any, minimum: float | None = None) -> None:
    if isinstance(value, Sequence) and not isinstance(value, str):
        for item in value:
            _check_number(key, item, minimum)
    else:
        _check_number(key, value, minimum)


def _check_int(key: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"scheduler.params.{key} must be an integer >= {minimum}, got {value!r}")


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"scheduler.params.{key} must be true or false, got {value!r}")


def _check_total_after_warmup(total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        raise ConfigError(
            f"scheduler.params.total_num_steps={total_num_steps} is less than "
            f"scheduler.params.warmup_num_steps={warmup_num_steps}; the decay would never run"
        )


__all__ = [
    "LRRangeTest",
    "LRRangeTestParams",
    "LRSchedulerLike",
    "OneCycle",
    "OneCycleParams",
    "WarmupCosineLR",
    "WarmupCosineLRParams",
    "WarmupDecayLR",
    "WarmupDecayLRParams",
    "WarmupLR",
    "WarmupLRParams",
    "build_lr_scheduler",
    "supported_scheduler_names",
]
