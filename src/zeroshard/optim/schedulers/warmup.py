"""The warmup schedules: WarmupLR, WarmupDecayLR (then a linear decay) and WarmupCosineLR (then a cosine).

Where zeroshard is stricter than DeepSpeed (which warns and carries on): an unknown `warmup_type` and
`total_num_steps < warmup_num_steps` are ConfigErrors. `warmup_num_steps: 0` is accepted (as DeepSpeed
before 0.18 did, and as the Hugging Face "auto" value produces) and, like every value below 2, is raised to 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.errors import ConfigError
from zeroshard.optim.schedulers.base import BatchLRScheduler, as_float
from zeroshard.optim.schedulers.checks import PerGroup, check_int, check_number, check_per_group, per_group

LOG_WARMUP = "log"
LINEAR_WARMUP = "linear"


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
        check_per_group("warmup_min_lr", self.warmup_min_lr, minimum=0.0)
        if self.warmup_max_lr is not None:
            check_per_group("warmup_max_lr", self.warmup_max_lr, minimum=0.0)
        check_int("warmup_num_steps", self.warmup_num_steps, minimum=0)
        _check_warmup_type(self.warmup_type)


@dataclass(frozen=True, kw_only=True)
class WarmupDecayLRParams(WarmupLRParams):
    """`scheduler.params` of WarmupDecayLR: WarmupLR, then a linear decay to 0 at `total_num_steps`."""

    total_num_steps: int
    """Iteration at which the lr reaches 0 (required)."""
    warmup_max_lr: PerGroup | None = 0.001
    """lr at the end of warmup (DeepSpeed's WarmupDecayLR default is 0.001, not the group lr)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("total_num_steps", self.total_num_steps, minimum=0)
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
        check_int("total_num_steps", self.total_num_steps, minimum=0)
        check_int("warmup_num_steps", self.warmup_num_steps, minimum=0)
        check_number("warmup_min_ratio", self.warmup_min_ratio, minimum=0.0)
        check_number("cos_min_ratio", self.cos_min_ratio, minimum=0.0)
        _check_warmup_type(self.warmup_type)
        _check_total_after_warmup(self.total_num_steps, self.warmup_num_steps)


class WarmupLR(BatchLRScheduler):
    """Warm the lr from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold it.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> sched = WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
        >>> for _ in range(6):
        ...     sched.step()
        >>> round(opt.param_groups[0]["lr"], 6)
        0.05
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = LOG_WARMUP,
        last_batch_iteration: int = -1,
    ) -> None:
        params = WarmupLRParams(
            warmup_min_lr=warmup_min_lr,
            warmup_max_lr=warmup_max_lr,
            warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type,
        )
        self._setup(optimizer, params, last_batch_iteration)

    def _setup(self, optimizer: torch.optim.Optimizer, params: WarmupLRParams, last_batch_iteration: int) -> None:
        """The constructor's work once the keywords are validated (WarmupDecayLR validates its own first)."""
        BatchLRScheduler.__init__(self, optimizer, last_batch_iteration)
        groups = len(optimizer.param_groups)
        max_lr = params.warmup_max_lr
        if max_lr is None:
            max_lr = [as_float(g["lr"]) for g in optimizer.param_groups]
        # [Note: lrs read from the optimizer] A base lr taken from the param groups is saved in state_dict():
        # on resume the groups hold the lr of the saved step, not the configured one.
        self._max_lrs_from_groups = params.warmup_max_lr is None
        self.min_lrs = per_group("warmup_min_lr", params.warmup_min_lr, groups)
        self._set_max_lrs(per_group("warmup_max_lr", max_lr, groups))
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

    def _load_settings(self, state_dict: dict[str, Any]) -> None:
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
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = LOG_WARMUP,
        last_batch_iteration: int = -1,
    ) -> None:
        params = WarmupDecayLRParams(
            total_num_steps=total_num_steps,
            warmup_min_lr=warmup_min_lr,
            warmup_max_lr=warmup_max_lr,
            warmup_num_steps=warmup_num_steps,
            warmup_type=warmup_type,
        )
        self.total_num_steps = params.total_num_steps
        self._setup(optimizer, params, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super()._gamma(iteration)
        remaining = float(self.total_num_steps - iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(BatchLRScheduler):
    """Scale each group's lr by a ratio warmed up from warmup_min_ratio to 1, then annealed to cos_min_ratio.

    The lr is 0 before the first step (DeepSpeed's iteration -1 ratio).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = LOG_WARMUP,
        last_batch_iteration: int = -1,
    ) -> None:
        params = WarmupCosineLRParams(
            total_num_steps=total_num_steps,
            warmup_min_ratio=warmup_min_ratio,
            warmup_num_steps=warmup_num_steps,
            cos_min_ratio=cos_min_ratio,
            warmup_type=warmup_type,
        )
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = params.total_num_steps
        self.warmup_min_ratio = params.warmup_min_ratio
        self.cos_min_ratio = params.cos_min_ratio
        self.warmup_type = params.warmup_type
        self.warmup_num_steps = max(2, params.warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lrs = [as_float(g["lr"]) for g in optimizer.param_groups]
        self._start()

    def state_dict(self) -> dict[str, Any]:
        """last_batch_iteration and the groups' original lrs (see [Note: lrs read from the optimizer])."""
        return {**super().state_dict(), "org_lrs": list(self.org_lrs)}

    def _load_settings(self, state_dict: dict[str, Any]) -> None:
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

    def get_lr_ratio(self) -> float:
        """DeepSpeed's name: the multiplier of the groups' original lr at the current iteration (0 before the first
        step)."""
        return self.lr_ratio(self.last_batch_iteration)

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.lr_ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]


def _warmup_fraction(warmup_type: str, iteration: int, num_steps: int, inverse_log: float) -> float:
    """Fraction of the warmup done at `iteration` (< num_steps), with DeepSpeed's exact arithmetic."""
    if warmup_type == LOG_WARMUP:
        return inverse_log * math.log(iteration + 1)
    return iteration / num_steps


def _check_warmup_type(warmup_type: str) -> None:
    if warmup_type not in (LOG_WARMUP, LINEAR_WARMUP):
        raise ConfigError(
            f"scheduler.params.warmup_type={warmup_type!r} is invalid; use {LOG_WARMUP!r} or {LINEAR_WARMUP!r}"
        )


def _check_total_after_warmup(total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        raise ConfigError(
            f"scheduler.params.total_num_steps={total_num_steps} is less than "
            f"scheduler.params.warmup_num_steps={warmup_num_steps}; the decay would never run"
        )
