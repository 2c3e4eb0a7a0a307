"""DeepSpeed's elasticity algorithm: one global batch size that many GPU counts can train with.

Pure functions, no process group (the facts are DeepSpeed's `deepspeed/elasticity/elasticity.py`,
v0.1 and v0.2). A global batch B is chosen among multiples of highly composite numbers so that as many
GPU counts as possible in [min_gpus, max_gpus] divide it with some allowed micro-batch; on a restart
with another valid world size, `elastic_batch_sizes` picks the micro-batch and gradient accumulation
that keep B, so the checkpoint resumes with the same optimisation.

Example:
    >>> batch, gpus = get_compatible_gpus_v01([8, 12, 16, 17], 10000, min_gpus=32, max_gpus=1500)
    >>> batch, len(gpus)
    (9792, 23)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

from zeroshard.errors import ConfigError

# The 38 smallest highly composite numbers (enough for batch sizes up to 720K), as in DeepSpeed.
HCN_LIST = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
    20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400,
    665280, 720720,
)  # fmt: skip
LATEST_VERSION = 0.2


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
        index = next(i for i, h in enumerate(HCN_LIST) if h > value)  # DeepSpeed's argmax(HCN > value)
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
    best_count, best_gpus, best_batch = 0, [], int(min(micro_batches))
    for batch in candidates:
        gpus = valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        better_tie = (prefer_larger and batch > best_batch) or (not prefer_larger and batch < best_batch)
        if len(gpus) > best_count or (len(gpus) == best_count and better_tie):
            best_count, best_gpus, best_batch = len(gpus), gpus, batch
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
    lcm = reduce(math.lcm, micro_batches)
    candidates = candidate_batch_sizes([*micro_batches, lcm], max_acceptable_batch_size)
    return best_candidate(candidates, micro_batches, min_gpus, max_gpus, prefer_larger)


def _micro_for(batch: int, world_size: int, micro_batches: Sequence[int], prefer_larger: bool) -> int | None:
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
    min_gpus: int | None = None,
    max_gpus: int | None = None,
    prefer_larger: bool = True,
    num_gpus_per_node: int = 1,
    model_parallel_size: int = 1,
) -> tuple[int, list[int], int | None]:
    """Elasticity v0.2 (node-level): (global batch, valid data-parallel sizes, micro-batch for this size)."""
    if num_gpus_per_node % model_parallel_size:
        raise ElasticityError(
            f"elasticity: num_gpus_per_node {num_gpus_per_node} must be divisible by model_parallel_size "
            f"{model_parallel_size}"
        )
    dp_per_node = num_gpus_per_node // model_parallel_size
    batch, valid_nodes = get_compatible_gpus_v01(
        micro_batches,
        int(max_acceptable_batch_size / dp_per_node),
        int((min_gpus or 1) / num_gpus_per_node),
        int((max_gpus or 0) / num_gpus_per_node),
        prefer_larger=prefer_larger,
    )
    batch = int(batch) * dp_per_node
    valid_dp = [n * dp_per_node for n in valid_nodes]
    if current_num_gpus // model_parallel_size in valid_dp:
        return batch, valid_dp, _micro_for(batch, current_num_gpus, micro_batches, prefer_larger)
    current_dp = (current_num_gpus / num_gpus_per_node) * dp_per_node
    candidates = [math.floor(max_acceptable_batch_size / (mb * current_dp)) * mb * current_dp for mb in micro_batches]
    chosen = int(max(candidates) if prefer_larger else min(candidates))
    return chosen, [int(current_dp)], _micro_for(chosen, current_num_gpus, micro_batches, prefer_larger)


@dataclass(frozen=True)
class ElasticConfig:
    """The `elasticity` block's fields the algorithm reads, with DeepSpeed's defaults."""

    max_train_batch_size: int = 2000
    micro_batch_sizes: tuple[int, ...] = (2, 4, 6)
    min_gpus: int = 1
    max_gpus: int = 10000
    num_gpus_per_node: int = 1
    model_parallel_size: int = 1
    prefer_larger_batch: bool = True
    version: float = LATEST_VERSION

    @classmethod
    def from_block(cls, block: Any) -> ElasticConfig:
        """From a mapping (the ds_config's "elasticity" dict) or an object with the same attributes."""
        get = block.get if isinstance(block, Mapping) else lambda k, d: getattr(block, k, d)
        fields = {f: get(f, getattr(cls, f)) for f in cls.__dataclass_fields__}
        fields["micro_batch_sizes"] = tuple(fields["micro_batch_sizes"])
        fields["version"] = float(fields["version"])
        return cls(**fields)


def compute_elastic_config(
    ds_config: Mapping[str, Any], target_deepspeed_version: str = "0.3.8", world_size: int = 0,
    return_microbatch: bool = False,
) -> tuple[int, list[int]] | tuple[int, list[int], int | None]:  # fmt: skip
    """DeepSpeed's `compute_elastic_config`: (batch, valid GPU counts[, micro-batch for world_size]).

    `target_deepspeed_version` is accepted for signature compatibility; zeroshard has no version gate.
    With `world_size > 0` it must be one of the valid counts and the micro-batch is returned too.
    """
    block = ds_config.get("elasticity")
    if not isinstance(block, Mapping) or not block.get("enabled", False):
        raise ElasticityError("elasticity: the block is missing or not enabled ('enabled': true)")
    cfg = ElasticConfig.from_block(block)
    if cfg.model_parallel_size > 1 and cfg.version != 0.2:
        raise ElasticityError(f"elasticity v{cfg.version} does not support model_parallel_size > 1")
    if cfg.version > LATEST_VERSION:
        raise ElasticityError(f"elasticity version {cfg.version}: the newest supported is {LATEST_VERSION}")
    micro_for_v02: int | None = None
    if cfg.version == 0.1:
        batch, gpus = get_compatible_gpus_v01(
            cfg.micro_batch_sizes, cfg.max_train_batch_size, cfg.min_gpus, cfg.max_gpus, cfg.prefer_larger_batch
        )
    elif cfg.version == 0.2:
        if world_size <= 0:
            raise ElasticityError("elasticity v0.2 needs the world size (pass world_size=)")
        batch, gpus, micro_for_v02 = get_compatible_gpus_v02(
            cfg.micro_batch_sizes,
            cfg.max_train_batch_size,
            world_size,
            cfg.min_gpus,
            cfg.max_gpus,
            cfg.prefer_larger_batch,
            cfg.num_gpus_per_node,
            cfg.model_parallel_size,
        )
    else:
        raise ElasticityError(f"elasticity version {cfg.version} is unknown (0.1 or 0.2)")
    batch = int(batch)
    if world_size > 0:
        if world_size not in gpus:
            raise ElasticityError(f"world size {world_size} is not one of the valid GPU counts {gpus}")
        micro = next(mb for mb in sorted(set(cfg.micro_batch_sizes), reverse=True) if batch // world_size % mb == 0)
        return batch, gpus, micro
    if return_microbatch:
        return batch, gpus, micro_for_v02
    return batch, gpus


@dataclass(frozen=True)
class ElasticBatch:
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    valid_gpus: tuple[int, ...]


def elastic_batch_sizes(elasticity: Any, world_size: int) -> ElasticBatch:
    """The batch triple DeepSpeed's config derives under elasticity for `world_size`:
    micro = the largest allowed micro-batch dividing batch / world_size, accumulation = the rest.

    Example:
        >>> block = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 3], "version": 0.1}
        >>> [(b.train_micro_batch_size_per_gpu, b.gradient_accumulation_steps) for b in
        ...  (elastic_batch_sizes(block, n) for n in (1, 2, 4))]
        [(3, 8), (3, 4), (3, 2)]
    """
    block = dict(elasticity) if isinstance(elasticity, Mapping) else vars(elasticity)
    result = compute_elastic_config({"elasticity": {**block, "enabled": True}}, world_size=world_size)
    batch, gpus, micro = result  # type: ignore[misc]
    assert micro is not None
    return ElasticBatch(batch, micro, batch // (micro * world_size), tuple(gpus))
