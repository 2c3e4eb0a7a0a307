"""What every schedule shares: the engine's view of a scheduler and DeepSpeed's batch-iteration convention."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class LRSchedulerLike(Protocol):
    """What the engine needs from a scheduler: ours and torch's both qualify."""

    def step(self) -> None: ...

    def get_last_lr(self) -> list[float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class BatchLRScheduler:
    """Base of the DeepSpeed-style schedules: the lr is a pure function of the batch iteration."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = [as_float(g["lr"]) for g in optimizer.param_groups]

    def _start(self) -> None:
        """Apply the initial values; subclasses call it at the end of their constructor."""
        if self.last_batch_iteration == -1:
            self._apply_initial()

    def _apply_initial(self) -> None:
        """Write the lr before the first step into the optimizer (DeepSpeed: the iteration -1 lr)."""
        self._last_lr = write_lrs(self.optimizer, self.get_lr())

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
        self._last_lr = write_lrs(self.optimizer, self.get_lr())

    def state_dict(self) -> dict[str, Any]:
        """`last_batch_iteration`: all of DeepSpeed's state (so a DeepSpeed dict loads too)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the iteration saved by state_dict(); the next step() continues the sequence. The iteration's lr
        is written into the optimizer: a load without the optimizer's state (`load_optimizer_states=False`) took its
        first step at the fresh optimizer's lr (warmup's 0), and `get_last_lr()` said it (DeepSpeed's does both); with
        the optimizer's state it is the lr the groups were saved with."""
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        self._load_settings(state_dict)
        if self.last_batch_iteration == -1:
            self._apply_initial()
        else:
            self._write_current()

    def _load_settings(self, state_dict: dict[str, Any]) -> None:
        """What a schedule saved beside its iteration (read before the iteration's values are written)."""

    def _write_current(self) -> None:
        """Write the current iteration's values into the optimizer."""
        self._last_lr = write_lrs(self.optimizer, self.get_lr())


def write_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> list[float]:
    """Write one lr per group (in place when a group holds its lr as a tensor); return the lrs written."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    return [as_float(group["lr"]) for group in optimizer.param_groups]


def as_float(value: Any) -> float:
    """An lr held as a float or a one-element tensor, as a float."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def step_scheduler(scheduler: Any, lr_kwargs: dict[str, Any] | None, train_batch_size: int) -> None:
    """The engine's scheduler step, as DeepSpeed's: `step(**lr_kwargs)`; without them, a scheduler whose `step` needs
    an argument (Megatron's `AnnealingLR.step(increment)`, under the pipeline engine) is given the train batch
    size, where DeepSpeed retries after a TypeError (which also hid TypeErrors raised inside `step`). A scheduler
    that steps on a metric (`steps_on_a_metric`) is left to its owner: DeepSpeed's retry handed ReduceLROnPlateau the
    batch size as its metric, which never improves, so the lr was cut every `patience` steps."""
    if lr_kwargs:
        scheduler.step(**lr_kwargs)
        return
    needs = _required_arguments(scheduler)
    if needs and needs[0] in _METRIC_NAMES:
        return
    if needs:
        scheduler.step(train_batch_size)
    else:
        scheduler.step()


_METRIC_NAMES = ("metrics", "metric")


def steps_on_a_metric(scheduler: Any) -> bool:
    """Whether `scheduler.step` takes an evaluation metric (torch's ReduceLROnPlateau, transformers' GreedyLR): its
    owner steps it after each evaluation, the engine does not ([Note: the Trainer's schedulers] in hf/schedulers.py).

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> steps_on_a_metric(torch.optim.lr_scheduler.ReduceLROnPlateau(opt)), steps_on_a_metric(None)
        (True, False)
    """
    needs = _required_arguments(scheduler) if hasattr(scheduler, "step") else []
    return bool(needs) and needs[0] in _METRIC_NAMES


def _required_arguments(scheduler: Any) -> list[str]:
    """The names of `scheduler.step`'s positional parameters without a default."""
    try:
        return [
            p.name
            for p in inspect.signature(scheduler.step).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # (a builtin without a signature)
        return []
