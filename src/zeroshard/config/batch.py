"""Batch-size arithmetic: train_batch_size = micro batch per GPU * accumulation steps * world size.

Pure functions, no process group. Given any two of the three numbers the third is derived; given
only train_batch_size, accumulation is 1; given only the micro batch, accumulation is 1 (these are
DeepSpeed's rules in DeepSpeedConfig._set_batch_related_parameters). Where DeepSpeed floors a
division and then fails its assertion, we name the numbers that do not divide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from zeroshard.errors import ConfigError

TRAIN: Final = "train_batch_size"
MICRO: Final = "train_micro_batch_size_per_gpu"
ACCUM: Final = "gradient_accumulation_steps"
BATCH_KEYS: Final = (TRAIN, MICRO, ACCUM)


@dataclass(frozen=True)
class BatchSizes:
    """The completed, consistent batch triple."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def _divide(numerator: int, numerator_name: str, factors: list[tuple[str, int]], derived: str) -> int:
    denominator = 1
    for _, value in factors:
        denominator *= value
    if numerator % denominator:
        product = " * ".join(f"{name} {value}" for name, value in factors)
        raise ConfigError(
            f"{numerator_name} {numerator} is not divisible by {product} (= {denominator}), so {derived} "
            f"cannot be derived; choose sizes with {TRAIN} = {MICRO} * {ACCUM} * world_size"
        )
    return numerator // denominator


def complete_batch(train: int | None, micro: int | None, accum: int | None, world_size: int) -> BatchSizes:
    """Derive the missing batch numbers from the given ones (None = not given) and check the product."""
    if world_size < 1:
        raise ConfigError(f"world_size {world_size} must be >= 1")
    ws = ("world_size", world_size)
    if train is not None and micro is not None and accum is None:
        accum = _divide(train, TRAIN, [(MICRO, micro), ws], ACCUM)
    elif train is not None and accum is not None and micro is None:
        micro = _divide(train, TRAIN, [(ACCUM, accum), ws], MICRO)
    elif train is not None and micro is None:
        accum, micro = 1, _divide(train, TRAIN, [ws], MICRO)
    elif micro is not None:
        accum = 1 if accum is None else accum
        train = micro * accum * world_size if train is None else train
    if train is None or micro is None or accum is None:
        raise ConfigError(
            f"none of {TRAIN} and {MICRO} is set (set one of them in the config); "
            f"{ACCUM} alone does not fix the batch size"
        )
    if train != micro * accum * world_size:
        raise ConfigError(
            f"{TRAIN} {train} != {MICRO} {micro} * {ACCUM} {accum} * world_size {world_size} "
            f"(= {micro * accum * world_size})"
        )
    return BatchSizes(train, micro, accum)
