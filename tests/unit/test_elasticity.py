"""DeepSpeed's elasticity algorithm (deepspeed/elasticity/elasticity.py, v0.15) and where initialize applies it.

The vectors are those of DeepSpeed's tests/unit/elasticity/test_elastic.py (v0.15.0), plus values printed by
that release's compute_elastic_config for the other cases (marked "DeepSpeed 0.15 prints").
"""

from __future__ import annotations

import json

import pytest

from zeroshard.checkpoint.elasticity import (
    ElasticityError,
    compute_elastic_config,
    elastic_batch_sizes,
    get_compatible_gpus_v01,
)
from zeroshard.config import parse_config, resolve_config
from zeroshard.errors import ConfigError


@pytest.fixture
def ds_config() -> dict:
    block = {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32}
    return {"elasticity": {**block, "max_gpus": 1500, "min_time": 20, "version": 0.1}}


def test_basic_10k(ds_config):
    batch, gpus = compute_elastic_config(ds_config, "0.15.0")
    assert batch == 9792 and len(gpus) == 23
    assert all(batch % g == 0 and any(batch // g % m == 0 for m in (8, 12, 16, 17)) for g in gpus)


def test_valid_and_invalid_world_size(ds_config):
    assert compute_elastic_config(ds_config, "0.15.0", world_size=64)[2] == 17
    with pytest.raises(ElasticityError, match="world size 128 is not one of the valid GPU counts"):
        compute_elastic_config(ds_config, "0.15.0", world_size=128)


def test_proper_micro_batch(ds_config):
    ds_config["elasticity"].update(max_train_batch_size=32, micro_batch_sizes=[1, 2, 3, 7], min_gpus=1)
    assert compute_elastic_config(ds_config, "0.15.0", world_size=7)[2] == 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"enabled": False}, "not enabled"),
        ({"version": "0.3"}, "newest supported is 0.2"),
        ({"max_train_batch_size": None}, "max_train_batch_size is missing"),
        ({"micro_batch_sizes": None}, "micro_batch_sizes is missing"),
        ({"model_parallel_size": 4, "num_gpus_per_node": 8}, "does not support model_parallel_size"),
        ({"micro_batch_sizes": [1, 4, -1, 2, -10]}, "positive integers"),
        ({"micro_batch_sizes": 5}, "positive integers"),
        ({"micro_batch_sizes": ["a", None, 0.5]}, "positive integers"),
        ({"micro_batch_sizes": [2, 0.5, 4]}, "positive integers"),
        ({"min_gpus": -1}, "min_gpus -1 must be a positive integer"),
        ({"max_gpus": -1}, "max_gpus -1 must be a positive integer"),
    ],
)
def test_refused_blocks(ds_config, change, message):
    block = ds_config["elasticity"]
    for key, value in change.items():
        if value is None:
            del block[key]
        else:
            block[key] = value
    with pytest.raises(ElasticityError, match=message):
        compute_elastic_config(ds_config, "0.15.0")


def test_refused_versions_and_empty_block(ds_config):
    with pytest.raises(ElasticityError, match="DeepSpeed >= 0.3.8"):
        compute_elastic_config(ds_config, target_deepspeed_version="0.2")
    with pytest.raises(ElasticityError, match="missing"):
        compute_elastic_config({"elasticity": {"enabled": True}})


def test_v02_model_parallel(ds_config, monkeypatch):
    ds_config["elasticity"].update(version=0.2, model_parallel_size=16, num_gpus_per_node=8)
    with pytest.raises(ElasticityError, match="num_gpus_per_node 8 must be divisible"):
        compute_elastic_config(ds_config, "0.15.0", world_size=16)
    ds_config["elasticity"].update(model_parallel_size=4)
    monkeypatch.setenv("WORLD_SIZE", "16")  # v0.2 reads it when world_size is not passed
    assert compute_elastic_config(ds_config, "0.15.0") == (9996, [4])  # DeepSpeed 0.15 prints


def test_v02_node_level():
    """DeepSpeed 0.15 prints these for 4 GPUs per node; 6 GPUs (1.5 nodes) gets its own batch."""
    block = {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "num_gpus_per_node": 4}
    valid = [4, 8, 12, 16, 20, 24, 32, 40, 48, 60, 64, 80, 96, 120, 160, 192, 240, 320, 480, 960]
    assert compute_elastic_config({"elasticity": block}, world_size=8) == (1920, valid, 6)
    assert compute_elastic_config({"elasticity": block}, world_size=12) == (1920, valid, 4)
    assert compute_elastic_config({"elasticity": block}, world_size=6) == (1992, [6], 4)


def test_v01_defaults_and_tie_break():
    divisors_of_840 = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 15, 20, 21, 24, 28, 30, 35, 40, 42, 56, 60, 70, 84, 105, 120,
                       140, 168, 210, 280, 420, 840]  # fmt: skip
    assert get_compatible_gpus_v01([2, 4, 6], 2000) == (1680, divisors_of_840)
    larger, _ = get_compatible_gpus_v01([4], 100, prefer_larger=True)
    smaller, _ = get_compatible_gpus_v01([4], 100, prefer_larger=False)
    assert larger >= smaller


def test_restart_keeps_the_global_batch():
    """Another valid world size picks the micro-batch and accumulation that keep the same global batch."""
    block = {"max_train_batch_size": 16, "micro_batch_sizes": [1, 2, 4], "max_gpus": 4, "version": 0.1}
    picks = {n: elastic_batch_sizes(block, n) for n in (1, 2, 3, 4)}  # DeepSpeed 0.15: 12, micro 4 2 4 1
    assert {n: (p.train_batch_size, p.train_micro_batch_size_per_gpu) for n, p in picks.items()} == {
        1: (12, 4), 2: (12, 2), 3: (12, 4), 4: (12, 1)
    }  # fmt: skip
    for n, p in picks.items():
        assert p.train_micro_batch_size_per_gpu * p.gradient_accumulation_steps * n == 12


ELASTIC_BLOCK = {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [1, 2], "max_gpus": 4, "version": 0.1}


def _resolved(config: dict, world_size: int) -> tuple[int, int, int]:
    cfg = resolve_config(parse_config(config), world_size=world_size)
    return cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps


def test_resolve_config_applies_the_block():
    """The batch triple follows the world size; the global batch stays 8 (DeepSpeed 0.15: 8, [1, 2, 4], micro 2)."""
    assert _resolved({"elasticity": ELASTIC_BLOCK}, 4) == (8, 2, 1)
    assert _resolved({"elasticity": ELASTIC_BLOCK}, 2) == (8, 2, 2)
    assert _resolved({"elasticity": {**ELASTIC_BLOCK, "enabled": False}, "train_batch_size": 6}, 2) == (6, 3, 1)


def test_resolve_config_refuses_an_incompatible_world_size():
    with pytest.raises(ConfigError) as err:
        _resolved({"elasticity": ELASTIC_BLOCK}, 3)
    message = str(err.value)
    assert "\n" not in message and "elasticity" in message and "world size 3" in message and "[1, 2, 4]" in message


def test_non_elastic_batch_keys(caplog):
    """DeepSpeed's TestNonElasticBatchParams / ...WithOverride: batch keys next to the block are an error,
    unless ignore_non_elastic_batch_info, which overrides them with a warning."""
    config = {"train_batch_size": 2, "elasticity": ELASTIC_BLOCK}
    with pytest.raises(ConfigError, match="ignore_non_elastic_batch_info"):
        _resolved(config, 2)
    config["elasticity"] = {**ELASTIC_BLOCK, "ignore_non_elastic_batch_info": True}
    assert _resolved(config, 2) == (8, 2, 2)


def test_scheduler_copy_must_agree(monkeypatch):
    """DeepSpeed's TestElasticConfigChanged: DEEPSPEED_ELASTICITY_CONFIG names what the scheduler scaled by."""
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({**ELASTIC_BLOCK, "max_train_batch_size": 27}))
    with pytest.raises(ConfigError, match="elasticity.max_train_batch_size is 8 here but 27"):
        _resolved({"elasticity": ELASTIC_BLOCK}, 2)
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", json.dumps({"elasticity": ELASTIC_BLOCK}))
    assert _resolved({"elasticity": ELASTIC_BLOCK}, 2) == (8, 2, 2)
