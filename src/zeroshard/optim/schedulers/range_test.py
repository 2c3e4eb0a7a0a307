"""LRRangeTest: grow the lr from a small value to find the largest one training tolerates."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zeroshard.optim.schedulers.base import BatchLRScheduler, write_lrs
from zeroshard.optim.schedulers.checks import PerGroup, check_bool, check_int, check_number, check_per_group, per_group


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
        check_per_group("lr_range_test_min_lr", self.lr_range_test_min_lr, minimum=0.0)
        check_int("lr_range_test_step_size", self.lr_range_test_step_size, minimum=1)
        check_number("lr_range_test_step_rate", self.lr_range_test_step_rate)
        check_bool("lr_range_test_staircase", self.lr_range_test_staircase)


class LRRangeTest(BatchLRScheduler):
    """Grow the lr from lr_range_test_min_lr linearly (or in stairs) to find the largest stable lr."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: PerGroup = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        params = LRRangeTestParams(
            lr_range_test_min_lr=lr_range_test_min_lr,
            lr_range_test_step_size=lr_range_test_step_size,
            lr_range_test_step_rate=lr_range_test_step_rate,
            lr_range_test_staircase=lr_range_test_staircase,
        )
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = per_group("lr_range_test_min_lr", params.lr_range_test_min_lr, len(optimizer.param_groups))
        self.step_size = params.lr_range_test_step_size
        self.step_rate = params.lr_range_test_step_rate
        self.staircase = params.lr_range_test_staircase
        self._start()

    def _apply_initial(self) -> None:
        self._last_lr = write_lrs(self.optimizer, self.min_lrs)

    def lr_at(self, iteration: int) -> list[float]:
        interval: float = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [low * increase for low in self.min_lrs]
