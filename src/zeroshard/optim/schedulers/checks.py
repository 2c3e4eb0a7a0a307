"""Checks of `scheduler.params` values, each raising a ConfigError that names the key."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from zeroshard.errors import ConfigError

PerGroup = float | Sequence[float]
"""A value for every param group, or one value per group."""


def per_group(key: str, value: PerGroup, groups: int) -> list[float]:
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


def check_number(key: str, value: Any, minimum: float | None = None) -> None:
    if not _is_number(value) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"scheduler.params.{key} must be a finite number{bound}, got {value!r}")


def check_per_group(key: str, value: Any, minimum: float | None = None) -> None:
    if isinstance(value, Sequence) and not isinstance(value, str):
        for item in value:
            check_number(key, item, minimum)
    else:
        check_number(key, value, minimum)


def check_int(key: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"scheduler.params.{key} must be an integer >= {minimum}, got {value!r}")


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"scheduler.params.{key} must be true or false, got {value!r}")
