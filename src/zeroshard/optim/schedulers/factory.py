"""`build_lr_scheduler`: ds_config `scheduler.type` / `scheduler.params` to a scheduler over an optimizer.

The type names a DeepSpeed schedule (its params validated against its frozen dataclass) or any
`torch.optim.lr_scheduler` class (its params passed as keyword arguments); matched exactly, then ignoring case.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, cast

import torch

from zeroshard.errors import ConfigError
from zeroshard.optim.schedulers import one_cycle, range_test, warmup
from zeroshard.optim.schedulers.base import BatchLRScheduler, LRSchedulerLike
from zeroshard.optim.schedulers.checks import check_int

_ScheduleFactory = Callable[..., BatchLRScheduler]  # DeepSpeed's signature: (optimizer, **params, last_batch_iteration)

_SCHEDULES: Mapping[str, tuple[_ScheduleFactory, type[Any]]] = MappingProxyType(
    {
        "WarmupLR": (warmup.WarmupLR, warmup.WarmupLRParams),
        "WarmupDecayLR": (warmup.WarmupDecayLR, warmup.WarmupDecayLRParams),
        "WarmupCosineLR": (warmup.WarmupCosineLR, warmup.WarmupCosineLRParams),
        "OneCycle": (one_cycle.OneCycle, one_cycle.OneCycleParams),
        "LRRangeTest": (range_test.LRRangeTest, range_test.LRRangeTestParams),
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
    check_int("last_batch_iteration", last_batch_iteration, minimum=-1)
    fields = {f.name: f for f in dataclasses.fields(params_cls)}
    _check_param_names(name, kwargs, list(fields))
    missing = [
        f.name
        for f in fields.values()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in kwargs
    ]
    if missing:
        raise ConfigError(f"scheduler.params.{missing[0]} is required by {name}")
    # the names and required keys are checked above, so the constructor's own errors are the values' ConfigErrors
    return scheduler_cls(optimizer, **kwargs, last_batch_iteration=last_batch_iteration)


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
