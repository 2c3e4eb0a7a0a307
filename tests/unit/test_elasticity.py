"""DeepSpeed's elasticity algorithm (deepspeed/elasticity/elasticity.py), as pure functions."""

from __future__ import annotations

import pytest

from zeroshard.checkpoint.elasticity import (
    ElasticityError,
    compute_elastic_config,
    elastic_batch_sizes,
    get_compatible_gpus_v01,
)

ISSUE_BLOCK = {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17]}


def test_issue_vector_v01_and_v02():
    """max 10000, micro-batches [8, 12, 16, 17], 32-1500 GPUs: batch 9792 and 23 valid GPU counts."""
    block = {**ISSUE_BLOCK, "min_gpus": 32, "max_gpus": 1500}
    batch, gpus = compute_elastic_config({"elasticity": {**block, "version": 0.1}})
    assert batch == 9792 and len(gpus) == 23
    assert gpus[0] == 32 and gpus[-1] == 1224 and all(any(batch // g % m == 0 for m in (8, 12, 16, 17)) for g in gpus)
    batch2, gpus2, micro = compute_elastic_config({"elasticity": {**block, "version": 0.2}}, world_size=64)
    assert (batch2, gpus2) == (batch, gpus) and micro == 17  # 9792 / 64 = 153 = 9 x 17


def test_v01_defaults_and_tie_break():
    # DeepSpeed's own output for its documented defaults (checked against deepspeed 0.14's elasticity.py)
    divisors_of_840 = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60, 70, 84, 105, 120,
                       140, 168, 210, 280, 420, 840]  # fmt: skip
    assert get_compatible_gpus_v01([2, 4, 6], 2000) == (1680, divisors_of_840)
    larger, _ = get_compatible_gpus_v01([4], 100, prefer_larger=True)
    smaller, _ = get_compatible_gpus_v01([4], 100, prefer_larger=False)
    assert larger >= smaller


def test_restart_keeps_the_global_batch():
    """Another valid world size picks the micro-batch and accumulation that keep the same global batch."""
    block = {"max_train_batch_size": 24, "micro_batch_sizes": [2, 3], "version": 0.1}
    picks = {n: elastic_batch_sizes(block, n) for n in (1, 2, 4)}
    assert {p.train_batch_size for p in picks.values()} == {24}
    for n, p in picks.items():
        assert p.train_micro_batch_size_per_gpu * p.gradient_accumulation_steps * n == 24
    with pytest.raises(ElasticityError, match="world size 5"):
        elastic_batch_sizes(block, 5)


def test_errors():
    with pytest.raises(ElasticityError, match="not enabled"):
        compute_elastic_config({"elasticity": {"enabled": False}})
    with pytest.raises(ElasticityError, match="world size"):
        compute_elastic_config({"elasticity": {**ISSUE_BLOCK, "version": 0.2}})
    with pytest.raises(ElasticityError, match="<= max_train_batch_size"):
        get_compatible_gpus_v01([64], 32)
