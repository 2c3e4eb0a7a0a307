"""DeepSpeed's elasticity algorithm: one global batch size that many GPU counts can train with.

Pure functions, no process group (the facts are DeepSpeed's `deepspeed/elasticity/elasticity.py` and
`config.py` of v0.14-0.16, v0.1 and v0.2). A global batch B is chosen among multiples of highly
composite numbers so that as many GPU counts as possible in [min_gpus, max_gpus] divide it with some
allowed micro-batch; on a restart with another valid world size, `elastic_batch_sizes` picks the
micro-batch and gradient accumulation that keep B, so the checkpoint resumes with the same optimisation.
`apply_elasticity` is what `resolve_config` calls: see [Note: elasticity at initialize]. It lives in
config/ because it is batch arithmetic and the config layer imports no torch; `zeroshard.checkpoint`
re-exports it (checkpoint/elasticity.py), where DeepSpeed users look for it next to resharding.

Example:
    >>> batch, gpus = get_compatible_gpus_v01([8, 12, 16, 17], 10000, min_gpus=32, max_gpus=1500)
    >>> batch, len(gpus)
    (9792, 23)

[Note: elasticity at initialize]
DeepSpeed's config (runtime/config.py, up to 0.16) does this when `elasticity.enabled`: compute the
batch for the data-parallel world size; refuse a world size that is not among the valid counts; refuse
a config that also sets train_batch_size, train_micro_batch_size_per_gpu or gradient_accumulation_steps
unless `ignore_non_elastic_batch_info` (then they are overridden with a warning); check the block
against the scheduler's copy in DEEPSPEED_ELASTICITY_CONFIG when set; then set the batch triple to
(batch, micro, batch // (micro * world)). zeroshard does the same in `resolve_config`, on the user's
raw mapping (so a missing max_train_batch_size is an error, as in DeepSpeed, not a silent default).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zeroshard.errors import ConfigError
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

# The 38 smallest highly composite numbers (enough for batch sizes up to 720K), as in DeepSpeed.
HCN_LIST = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
    20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400,
    665280, 720720,
)  # fmt: skip
LATEST_VERSION = 0.2
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
SCHEDULER_ENV = "DEEPSPEED_ELASTICITY_CONFIG"


class ElasticityError(ConfigError):
    """The elasticity block cannot produce a batch size, or the world size is not one of its GPU counts."""


def candidate_batch_sizes(bases: Sequence[int], max_batch: int) -> list[int]:
    """For each base, the largest base x HCN that is <= max_batch (a base >= max_batch stays itself)."""
    candidates = set()
    for base in bases:
        if base >= max_batch:
            candidates.add(base)
            continue
        value = max_batch // base
        # DeepSpeed's HCN_LIST[argmax(HCN > value) - 1]: past the list's end argmax is 0, so index -1
        index = next((i for i, h in enumerate(HCN_LIST) if h > value), 0)
        candidates.add(HCN_LIST[index - 1] * base)
    return sorted(candidates)


def valid_gpus(batch: int, micro_batches: Sequence[int], min_gpus: int, max_gpus: int) -> list[int]:
    """GPU counts in [min_gpus, max_gpus] that split `batch` into whole micro-batches of an allowed size."""
    found: set[int] = set()
    for micro in micro_batches:
        if batch % micro:
            continue
        most = batch // micro
        if min_gpus <= most <= max_gpus:
            found.add(most)
        for i in range(max(1, min_gpus), min(most // 2, max_gpus) + 1):  # DeepSpeed scans factors <= most/2
            if most % i == 0:
                found.add(i)
    return sorted(found)


def best_candidate(
    candidates: Sequence[int], micro_batches: Sequence[int], min_gpus: int, max_gpus: int, prefer_larger: bool
) -> tuple[int, list[int]]:
    """The candidate with the most valid GPU counts; ties go to the larger (or smaller) batch."""
    best_count, best_batch = 0, int(min(micro_batches))
    best_gpus: list[int] | None = None
    for batch in candidates:
        gpus = valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        better_tie = (prefer_larger and batch > best_batch) or (not prefer_larger and batch < best_batch)
        if len(gpus) > best_count or (len(gpus) == best_count and better_tie):
            best_count, best_gpus, best_batch = len(gpus), gpus, batch
    if best_gpus is None:  # DeepSpeed goes on with None here and fails later with a TypeError
        raise ElasticityError(
            f"elasticity: no GPU count in [{min_gpus}, {max_gpus}] splits a batch of {list(candidates)} into "
            f"micro-batches of {list(micro_batches)}; lower elasticity.min_gpus or raise max_train_batch_size"
        )
    return best_batch, best_gpus


def get_compatible_gpus_v01(
    micro_batches: Sequence[int],
    max_acceptable_batch_size: int,
    min_gpus: int | None = None,
    max_gpus: int | None = None,
    prefer_larger: bool = True,
) -> tuple[int, list[int]]:
    """Elasticity v0.1: (global batch, valid GPU counts)."""
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_acceptable_batch_size // min(micro_batches)
    if not all(mb <= max_acceptable_batch_size for mb in micro_batches):
        raise ElasticityError(
            f"elasticity.micro_batch_sizes {list(micro_batches)}: every micro-batch must be <= "
            f"max_train_batch_size {max_acceptable_batch_size}"
        )
    lcm = math.lcm(*micro_batches)
    candidates = candidate_batch_sizes([*micro_batches, lcm], max_acceptable_batch_size)
    return best_candidate(candidates, micro_batches, min_gpus, max_gpus, prefer_larger)


def _micro_for(batch: float, world_size: int, micro_batches: Sequence[int], prefer_larger: bool) -> int | None:
    """v0.2's pick: the first dividing micro-batch in the list's order, or the largest if prefer_larger."""
    chosen = None
    for micro in micro_batches:
        if batch // world_size % micro == 0:
            if chosen is None or (prefer_larger and micro > chosen):
                chosen = micro
    return chosen


def get_compatible_gpus_v02(
    micro_batches: Sequence[int],
    max_acceptable_batch_size: int,
    current_num_gpus: int,
    min_gpus: int = 1,
    max_gpus: int = 10000,
    prefer_larger: bool = True,
    num_gpus_per_node: int = 1,
    model_parallel_size: int = 1,
) -> tuple[int, list[int], int | None]:
    """Elasticity v0.2 (node-level): (global batch, valid data-parallel sizes, micro-batch for this size).

    v0.1 runs on whole nodes (max batch / data-parallel ranks per node, GPU bounds / GPUs per node); a
    world size outside the result gets the largest (or smallest) multiple of micro x dp below the max.
    """
    if num_gpus_per_node % model_parallel_size:
        raise ElasticityError(
            f"elasticity.num_gpus_per_node {num_gpus_per_node} must be divisible by "
            f"elasticity.model_parallel_size {model_parallel_size}"
        )
    dp_per_node = num_gpus_per_node // model_parallel_size
    batch, valid_nodes = get_compatible_gpus_v01(
        micro_batches,
        int(max_acceptable_batch_size / dp_per_node),
        int(min_gpus / num_gpus_per_node),
        int(max_gpus / num_gpus_per_node),
        prefer_larger=prefer_larger,
    )
    batch = int(batch) * dp_per_node
    valid_dp = [n * dp_per_node for n in valid_nodes]
    if current_num_gpus // model_parallel_size in valid_dp:
        return batch, valid_dp, _micro_for(batch, current_num_gpus, micro_batches, prefer_larger)
    current_dp = (current_num_gpus / num_gpus_per_node) * dp_per_node  # a float in DeepSpeed too
    candidates = [math.floor(max_acceptable_batch_size / (mb * current_dp)) * mb * current_dp for mb in micro_batches]
    chosen = max(candidates) if prefer_larger else min(candidates)
    return int(chosen), [int(current_dp)], _micro_for(chosen, current_num_gpus, micro_batches, prefer_larger)


@dataclass(frozen=True)
class ElasticConfig:
    """The `elasticity` block, checked as DeepSpeed's ElasticityConfig checks it (defaults are DeepSpeed's)."""

    max_train_batch_size: int = 2000
    micro_batch_sizes: tuple[int, ...] = (2, 4, 6)
    min_gpus: int = 1
    max_gpus: int = 10000
    num_gpus_per_node: int = 1
    model_parallel_size: int = 1
    min_time: int = 0
    prefer_larger_batch: bool = True
    ignore_non_elastic_batch_info: bool = False
    version: float = LATEST_VERSION

    @classmethod
    def from_block(cls, block: Mapping[str, Any]) -> ElasticConfig:
        """From the ds_config's "elasticity" dict; an enabled block must name its batch bounds."""
        if block.get("enabled", False):
            for key in ("max_train_batch_size", "micro_batch_sizes"):
                if key not in block:
                    raise ElasticityError(f"elasticity.{key} is missing; an enabled elasticity block must set it")
        fields = {f: block.get(f, getattr(cls, f)) for f in cls.__dataclass_fields__}
        micro = fields["micro_batch_sizes"]
        if not isinstance(micro, list | tuple) or not all(_is_int(m) and m > 0 for m in micro) or not micro:
            raise ElasticityError(f"elasticity.micro_batch_sizes {micro!r} must be a list of positive integers")
        fields["micro_batch_sizes"] = tuple(micro)
        for key in ("max_train_batch_size", "min_gpus", "max_gpus", "num_gpus_per_node", "model_parallel_size"):
            if not _is_int(fields[key]) or fields[key] < 1:
                raise ElasticityError(f"elasticity.{key} {fields[key]!r} must be a positive integer")
        if fields["max_gpus"] < fields["min_gpus"]:
            raise ElasticityError(
                f"elasticity.min_gpus {fields['min_gpus']} is greater than elasticity.max_gpus {fields['max_gpus']}"
            )
        if not isinstance(fields["min_time"], int | float) or fields["min_time"] < 0:
            raise ElasticityError(f"elasticity.min_time {fields['min_time']!r} must be >= 0")
        try:
            fields["version"] = float(fields["version"])
        except (TypeError, ValueError):
            raise ElasticityError(f"elasticity.version {fields['version']!r} must be 0.1 or 0.2") from None
        return cls(**fields)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def compute_elastic_config(
    ds_config: Mapping[str, Any], target_deepspeed_version: str = "0.3.8", world_size: int = 0,
    return_microbatch: bool = False,
) -> tuple[int, list[int]] | tuple[int, list[int], int | None]:  # fmt: skip
    """DeepSpeed's `compute_elastic_config`: (batch, valid GPU counts[, micro-batch for world_size]).

    `target_deepspeed_version` is checked as DeepSpeed checks it (elasticity needs >= 0.3.8).
    With `world_size > 0` it must be one of the valid counts and the micro-batch is returned too; v0.2
    without `world_size` reads WORLD_SIZE from the environment, as DeepSpeed does.
    """
    block = ds_config.get("elasticity")
    if not isinstance(block, Mapping):
        raise ElasticityError("elasticity: the block is missing from the config")
    if not block.get("enabled", False):
        raise ElasticityError("elasticity: the block is not enabled ('enabled': true)")
    cfg = ElasticConfig.from_block(block)
    if cfg.model_parallel_size > 1 and cfg.version != 0.2:
        raise ElasticityError(f"elasticity.version {cfg.version} does not support model_parallel_size > 1 (use 0.2)")
    if cfg.version > LATEST_VERSION:
        raise ElasticityError(f"elasticity.version {cfg.version}: the newest supported is {LATEST_VERSION}")
    if _version_tuple(target_deepspeed_version) < (0, 3, 8):
        raise ElasticityError(f"elasticity needs DeepSpeed >= 0.3.8, not {target_deepspeed_version}")
    micro_for_v02: int | None = None
    if cfg.version == 0.1:
        batch, gpus = get_compatible_gpus_v01(
            cfg.micro_batch_sizes, cfg.max_train_batch_size, cfg.min_gpus, cfg.max_gpus, cfg.prefer_larger_batch
        )
    elif cfg.version == 0.2:
        current = world_size or _world_size_from_env()
        batch, gpus, micro_for_v02 = get_compatible_gpus_v02(
            cfg.micro_batch_sizes,
            cfg.max_train_batch_size,
            current,
            cfg.min_gpus,
            cfg.max_gpus,
            cfg.prefer_larger_batch,
            cfg.num_gpus_per_node,
            cfg.model_parallel_size,
        )
    else:
        raise ElasticityError(f"elasticity.version {cfg.version} is unknown (0.1 or 0.2)")
    batch = int(batch)
    if world_size > 0:
        if world_size not in gpus:
            raise ElasticityError(
                f"elasticity: world size {world_size} is not one of the valid GPU counts {gpus} "
                f"(max_train_batch_size {cfg.max_train_batch_size}, micro_batch_sizes {list(cfg.micro_batch_sizes)}); "
                "restart on one of those counts"
            )
        return batch, gpus, _largest_micro(batch, world_size, cfg.micro_batch_sizes)
    if return_microbatch:
        return batch, gpus, micro_for_v02 if cfg.version == 0.2 else _largest_micro(batch, 0, cfg.micro_batch_sizes)
    return batch, gpus


def _largest_micro(batch: int, world_size: int, micro_batches: Sequence[int]) -> int:
    if world_size > 0:
        for micro in sorted(set(micro_batches), reverse=True):
            if batch // world_size % micro == 0:
                return micro
    raise ElasticityError(
        f"elasticity: no micro-batch of {list(micro_batches)} divides batch {batch} / world size {world_size}"
    )


def _world_size_from_env() -> int:
    value = os.environ.get("WORLD_SIZE", "")
    if not value.isnumeric():
        raise ElasticityError(
            f"elasticity.version 0.2 needs the world size: pass world_size= or set WORLD_SIZE (it is {value!r})"
        )
    return int(value)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in str(version).split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@dataclass(frozen=True)
class ElasticBatch:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    valid_gpus: tuple[int, ...]


def elastic_batch_sizes(elasticity: Mapping[str, Any], world_size: int) -> ElasticBatch:
    """The batch triple DeepSpeed's config derives under elasticity for `world_size`:
    micro = the largest allowed micro-batch dividing batch / world_size, accumulation = the rest.

    Example:
        >>> block = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 3], "version": 0.1}
        >>> [(b.train_micro_batch_size_per_gpu, b.gradient_accumulation_steps) for b in
        ...  (elastic_batch_sizes(block, n) for n in (1, 2, 4))]
        [(3, 8), (3, 4), (3, 2)]
    """
    result = compute_elastic_config({"elasticity": {**elasticity, "enabled": True}}, world_size=world_size)
    batch, gpus, micro = result  # type: ignore[misc]
    if batch < 1 or micro is None:
        raise ElasticityError(
            f"elasticity.max_train_batch_size {elasticity.get('max_train_batch_size')} is smaller than one "
            f"micro-batch per rank at world size {world_size}"
        )
    return ElasticBatch(batch, micro, batch // (micro * world_size), tuple(gpus))


def apply_elasticity(raw: Mapping[str, Any], world_size: int) -> ElasticBatch | None:
    """The batch triple an enabled `elasticity` block of the ds_config `raw` sets for `world_size`
    (the data-parallel size), or None when the block is absent or disabled. See [Note: elasticity at
    initialize]; raises ElasticityError, one line naming the key, when the block or world size does not fit."""
    block = raw.get("elasticity")
    if not isinstance(block, Mapping) or not block.get("enabled", False):
        return None
    cfg = ElasticConfig.from_block(block)
    check_scheduler_copy(block, os.environ.get(SCHEDULER_ENV))
    given = [key for key in BATCH_KEYS if key in raw]
    if given and not cfg.ignore_non_elastic_batch_info:
        raise ElasticityError(
            f"elasticity is enabled and chooses the batch sizes, but the config also sets {', '.join(given)}; "
            "remove them or set elasticity.ignore_non_elastic_batch_info true"
        )
    sizes = elastic_batch_sizes(block, world_size)
    for key in given:
        logger.warning(f"zeroshard: elasticity overrides {key} {raw[key]} -> {getattr(sizes, key)}")
    logger.info(
        f"zeroshard: elasticity: train_batch_size {sizes.train_batch_size} = micro "
        f"{sizes.train_micro_batch_size_per_gpu} x accumulation {sizes.gradient_accumulation_steps} x world size "
        f"{world_size}; valid GPU counts {list(sizes.valid_gpus)}"
    )
    return sizes


def check_scheduler_copy(block: Mapping[str, Any], scheduler_json: str | None) -> None:
    """DeepSpeed's ensure_immutable_elastic_config: the scheduler's copy of the block (JSON, the whole
    ds_config or the block) must agree on max_train_batch_size, micro_batch_sizes and version."""
    if not scheduler_json:
        return
    theirs = json.loads(scheduler_json)
    theirs = theirs.get("elasticity", theirs) if isinstance(theirs, dict) else {}
    for key in ("max_train_batch_size", "micro_batch_sizes", "version"):
        default = getattr(ElasticConfig, key)
        mine, other = _plain(block.get(key, default)), _plain(theirs.get(key, default))
        if mine != other:
            raise ElasticityError(
                f"elasticity.{key} is {mine!r} here but {other!r} in {SCHEDULER_ENV} (what the scheduler scaled by)"
            )


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value
