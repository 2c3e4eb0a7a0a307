"""OneCycle: the 1cycle policy (Smith 2018), with beta1 cycled opposite to the lr as DeepSpeed does."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zeroshard.optim.schedulers.base import BatchLRScheduler, write_lrs
from zeroshard.optim.schedulers.checks import PerGroup, check_bool, check_int, check_number, check_per_group, per_group
from zeroshard.utils.logging import get_logger

_BETA2 = 0.99  # DeepSpeed's OneCycle pins beta2 here whatever the optimizer had


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
        check_per_group("cycle_min_lr", self.cycle_min_lr, minimum=0.0)
        check_per_group("cycle_max_lr", self.cycle_max_lr, minimum=0.0)
        check_number("decay_lr_rate", self.decay_lr_rate)
        check_int("cycle_first_step_size", self.cycle_first_step_size, minimum=1)
        if self.cycle_second_step_size is not None:
            check_int("cycle_second_step_size", self.cycle_second_step_size, minimum=0)
        check_int("cycle_first_stair_count", self.cycle_first_stair_count, minimum=0)
        if self.cycle_second_stair_count is not None:
            check_int("cycle_second_stair_count", self.cycle_second_stair_count, minimum=0)
        check_int("decay_step_size", self.decay_step_size, minimum=0)
        check_bool("cycle_momentum", self.cycle_momentum)
        check_per_group("cycle_min_mom", self.cycle_min_mom, minimum=0.0)
        check_per_group("cycle_max_mom", self.cycle_max_mom, minimum=0.0)
        check_number("decay_mom_rate", self.decay_mom_rate)


class OneCycle(BatchLRScheduler):
    """The 1cycle policy (Smith 2018): lr rises then falls over one cycle, then optionally decays.

    With cycle_momentum and an optimizer that has `betas`, beta1 moves opposite to the lr and beta2 is set to
    0.99, exactly as DeepSpeed does. Before the first step the groups get cycle_min_lr and cycle_min_mom.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: PerGroup,
        cycle_max_lr: PerGroup,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: PerGroup = 0.8,
        cycle_max_mom: PerGroup = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        params = OneCycleParams(
            cycle_min_lr=cycle_min_lr,
            cycle_max_lr=cycle_max_lr,
            decay_lr_rate=decay_lr_rate,
            cycle_first_step_size=cycle_first_step_size,
            cycle_second_step_size=cycle_second_step_size,
            cycle_first_stair_count=cycle_first_stair_count,
            cycle_second_stair_count=cycle_second_stair_count,
            decay_step_size=decay_step_size,
            cycle_momentum=cycle_momentum,
            cycle_min_mom=cycle_min_mom,
            cycle_max_mom=cycle_max_mom,
            decay_mom_rate=decay_mom_rate,
        )
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
        self.min_lrs = per_group("cycle_min_lr", params.cycle_min_lr, groups)
        self.max_lrs = per_group("cycle_max_lr", params.cycle_max_lr, groups)
        self.decay_lr_rate = params.decay_lr_rate
        self.decay_mom_rate = params.decay_mom_rate
        self.skip_lr_decay = math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        self.cycle_momentum = params.cycle_momentum and self._has_betas()
        self.min_moms = per_group("cycle_min_mom", params.cycle_min_mom, groups)
        self.max_moms = per_group("cycle_max_mom", params.cycle_max_mom, groups)
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
        self._last_lr = write_lrs(self.optimizer, self.min_lrs)
        if self.cycle_momentum:
            _write_betas(self.optimizer, self.min_moms)

    def _write_current(self) -> None:
        super()._write_current()
        if self.cycle_momentum:
            _write_betas(self.optimizer, self.mom_at(self.last_batch_iteration))

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one batch, writing the lr and (with cycle_momentum) beta1 into every group."""
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            _write_betas(self.optimizer, self.mom_at(self.last_batch_iteration))

    def get_mom(self) -> list[tuple[float, float]] | None:
        """DeepSpeed's: each group's betas at the current iteration, (beta1, 0.99), as step() writes them; None
        without cycle_momentum (or when the optimizer has no betas)."""
        if not self.cycle_momentum:
            return None
        return [(beta1, _BETA2) for beta1 in self.mom_at(self.last_batch_iteration)]

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


def _write_betas(optimizer: torch.optim.Optimizer, beta1s: Sequence[float]) -> None:
    """Set each group's betas to (beta1, 0.99): DeepSpeed's OneCycle pins beta2 at 0.99."""
    for group, beta1 in zip(optimizer.param_groups, beta1s, strict=True):
        group["betas"] = (beta1, _BETA2)
