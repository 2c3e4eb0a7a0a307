"""Unit tests of ds_config resolution: batch math, "auto" values, and the real-world configs."""

from __future__ import annotations

import ast
import dataclasses
import json
import pathlib
from typing import Any

import pytest

from helpers.config_checks import DATA, error_of, warnings_of
from zeroshard.config import (
    AUTO,
    complete_batch,
    parse_config,
    resolve_config,
)
from zeroshard.errors import ConfigError

# --------------------------------------------------------------------------- batch math


@pytest.mark.parametrize(
    ("train", "micro", "accum", "expected"),
    [
        (32, 16, 1, (32, 16, 1)),
        (32, 8, 2, (32, 8, 2)),
        (32, 8, None, (32, 8, 2)),
        (32, None, 2, (32, 8, 2)),
        (None, 8, 2, (32, 8, 2)),
        (32, None, None, (32, 16, 1)),
        (None, 4, None, (8, 4, 1)),
    ],
)
def test_batch_triple_is_completed(
    train: int | None, micro: int | None, accum: int | None, expected: tuple[int, int, int]
) -> None:
    assert dataclasses.astuple(complete_batch(train, micro, accum, 2)) == expected
    cfg = resolve_config(
        parse_config(
            {
                "train_batch_size": train,
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": accum,
            }
        ),
        world_size=2,
    )
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == expected


@pytest.mark.parametrize(
    ("train", "micro", "accum", "message"),
    [
        (
            33,
            17,
            2,
            "train_batch_size 33 != train_micro_batch_size_per_gpu 17 * gradient_accumulation_steps 2 * "
            "world_size 2 (= 68)",
        ),
        (
            32,
            18,
            1,
            "train_batch_size 32 != train_micro_batch_size_per_gpu 18 * gradient_accumulation_steps 1 * "
            "world_size 2 (= 36)",
        ),
        (
            33,
            16,
            None,
            "train_batch_size 33 is not divisible by train_micro_batch_size_per_gpu 16 * world_size 2 "
            "(= 32), so gradient_accumulation_steps cannot be derived; choose sizes with train_batch_size "
            "= train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size",
        ),
        (
            33,
            None,
            None,
            "train_batch_size 33 is not divisible by world_size 2 (= 2), so "
            "train_micro_batch_size_per_gpu cannot be derived; choose sizes with train_batch_size = "
            "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size",
        ),
        (
            None,
            None,
            4,
            "none of train_batch_size and train_micro_batch_size_per_gpu is set (set one of them in the "
            "config); gradient_accumulation_steps alone does not fix the batch size",
        ),
        (
            None,
            None,
            None,
            "none of train_batch_size and train_micro_batch_size_per_gpu is set (set one of them in the "
            "config); gradient_accumulation_steps alone does not fix the batch size",
        ),
    ],
)
def test_inconsistent_batch_is_an_error(train: int | None, micro: int | None, accum: int | None, message: str) -> None:
    cfg = parse_config(
        {
            "train_batch_size": train,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": accum,
        }
    )
    with pytest.raises(ConfigError) as info:
        resolve_config(cfg, world_size=2)
    assert str(info.value) == message


def test_batch_error_says_which_numbers_came_from_known() -> None:
    cfg = parse_config({"train_batch_size": 32, "gradient_accumulation_steps": 4})
    with pytest.raises(ConfigError) as info:
        resolve_config(cfg, world_size=8, known={"train_micro_batch_size_per_gpu": 4})
    assert str(info.value) == (
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps "
        "4 * world_size 8 (= 128) (train_micro_batch_size_per_gpu given outside the config)"
    )


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        resolve_config(parse_config({"train_batch_size": 8}), world_size=0)


# --------------------------------------------------------------------------- "auto"


HF_AUTO = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def test_auto_is_kept_by_parse_and_resolved_into_a_new_config() -> None:
    cfg = parse_config(HF_AUTO)
    assert (
        cfg.train_batch_size is AUTO and cfg.fp16.enabled is AUTO and cfg.zero_optimization.reduce_bucket_size is AUTO
    )
    assert cfg.optimizer is not None and cfg.optimizer.params["lr"] is AUTO and not cfg.resolved
    out = resolve_config(
        cfg,
        world_size=2,
        known={"train_micro_batch_size_per_gpu": 4, "optimizer.params.lr": 1e-4, "hidden_size": 64},
    )
    assert out is not cfg and cfg.train_batch_size is AUTO and out.resolved
    assert (out.train_batch_size, out.train_micro_batch_size_per_gpu, out.gradient_accumulation_steps) == (
        8,
        4,
        1,
    )
    assert out.gradient_clipping == 1.0 and out.fp16.enabled is False and out.bf16.enabled is False
    assert out.optimizer is not None and out.optimizer.params == {
        "lr": 1e-4,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    assert out.scheduler is not None
    assert out.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 0}
    zero = out.zero_optimization
    assert (
        zero.reduce_bucket_size,
        zero.stage3_prefetch_bucket_size,
        zero.stage3_param_persistence_threshold,
    ) == (4096, 3686, 640)
    assert '"auto"' not in json.dumps(out.to_dict(include_defaults=False))


def test_known_values_fill_auto(log: pytest.LogCaptureFixture) -> None:
    known = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "optimizer.params.lr": 0.1,
        "optimizer.params.betas": [0.8, 0.9],
        "scheduler.params.warmup_num_steps": 7,
        "fp16.enabled": True,
        "gradient_clipping": 0.5,
        "zero_optimization.prefetch_bucket_size": 123,
        "hidden_size": 8,
    }
    out = resolve_config(parse_config(HF_AUTO), world_size=4, known=known)
    assert (out.train_batch_size, out.gradient_accumulation_steps) == (24, 3)
    assert out.fp16.enabled is True and out.gradient_clipping == 0.5
    assert out.zero_optimization.stage3_prefetch_bucket_size == 123 and out.zero_optimization.reduce_bucket_size == 64
    assert out.optimizer is not None and out.optimizer.params["betas"] == [0.8, 0.9]
    assert out.scheduler is not None and out.scheduler.params["warmup_max_lr"] == 0.1
    assert out.scheduler.params["warmup_num_steps"] == 7
    assert any(r.getMessage().startswith('zeroshard: resolved "auto": ') for r in log.records)


def test_known_never_overrides_the_config() -> None:
    cfg = parse_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        }
    )
    out = resolve_config(
        cfg,
        world_size=1,
        known={"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "optimizer.params.lr": 0.1},
    )
    assert out.train_micro_batch_size_per_gpu == 1 and out.gradient_clipping == 0.0
    assert out.optimizer is not None and out.optimizer.params["lr"] == 0.5


def test_any_key_path_can_come_from_known() -> None:
    cfg = parse_config(
        {
            "train_batch_size": 4,
            "zero_optimization": {"stage3_max_live_parameters": "auto"},
            "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": "auto"}},
        }
    )
    out = resolve_config(
        cfg,
        world_size=1,
        known={"zero_optimization.max_live_parameters": 7, "scheduler.params.cycle_max_lr": 0.3},
    )
    assert out.zero_optimization.stage3_max_live_parameters == 7
    assert out.scheduler is not None and out.scheduler.params["cycle_max_lr"] == 0.3


def test_auto_means_default_where_deepspeed_reads_it_so() -> None:
    cfg = parse_config(
        {
            "train_batch_size": 4,
            "zero_optimization": {"sub_group_size": "auto"},
            "fp16": {"loss_scale_window": "auto"},
        }
    )
    out = resolve_config(cfg, world_size=1)
    assert out.zero_optimization.sub_group_size == 1_000_000_000 and out.fp16.loss_scale_window == 1000


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"steps_per_print": "auto"}, 'steps_per_print: "auto" is not accepted for this key; set a value'),
        (
            {"zero_optimization": {"stage": "auto"}},
            'zero_optimization.stage: "auto" is not accepted for this key; set a value',
        ),
        (
            {"activation_checkpointing": {"partition_activations": "auto"}},
            'activation_checkpointing.partition_activations: "auto" is not accepted for this key; set a value',
        ),
        ({"optimizer": {"type": "auto"}}, 'optimizer.type: "auto" is not accepted for this key; set a value'),
    ],
)
def test_auto_where_nobody_fills_it_is_an_error(source: dict[str, Any], message: str) -> None:
    assert error_of(source) == message


def test_literal_auto_value_is_kept() -> None:
    assert parse_config({"data_types": {"keep_in_fp32_modules": "auto"}}).data_types.keep_in_fp32_modules == "auto"
    assert parse_config({"pipeline": {"stages": "auto"}}).pipeline == {"stages": "auto"}


@pytest.mark.parametrize(
    ("source", "known", "message"),
    [
        (
            HF_AUTO,
            {"train_micro_batch_size_per_gpu": 4, "hidden_size": 64},
            'optimizer.params.lr is "auto" and nothing resolved it; set a number in the config (the Hugging '
            "Face Trainer fills such values from its arguments; initialize alone cannot)",
        ),
        (
            {
                "train_batch_size": 8,
                "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
            },
            {},
            'scheduler.params.total_num_steps is "auto" and nothing resolved it; set a number in the config '
            "(the Hugging Face Trainer fills such values from its arguments; initialize alone cannot)",
        ),
        (
            {"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
            {},
            'scheduler.params.warmup_max_lr is "auto" and follows '
            "optimizer.params.lr, which nothing resolved; set a "
            "number in the config, or pass initialize a client optimizer (its lr is taken)",
        ),
        (
            {"train_batch_size": "auto", "gradient_accumulation_steps": "auto"},
            {},
            'train_batch_size and gradient_accumulation_steps are "auto" and nothing resolved them; set numbers in '
            "the config (the Hugging Face Trainer fills such values from its arguments; initialize alone cannot)",
        ),
        (
            {"train_batch_size": "auto"},
            {"train_batch_size": "8"},
            'train_batch_size (from known): "8" is not an int',
        ),
        (
            {"train_batch_size": 8, "fp16": {"enabled": "auto"}},
            {"fp16.enabled": 1},
            "fp16.enabled (from known): 1 is not a bool; use true or false",
        ),
        (
            {"train_batch_size": 8, "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}},
            {"fp16.enabled": True, "bf16.enabled": True},
            "fp16.enabled and bf16.enabled are both true; enable at most one of them",
        ),
    ],
)
def test_unresolvable_auto_names_the_key(source: dict[str, Any], known: dict[str, Any], message: str) -> None:
    cfg = parse_config(source)
    with pytest.raises(ConfigError) as info:
        resolve_config(cfg, world_size=2, known=known)
    assert str(info.value) == message


def test_resolve_is_idempotent() -> None:
    once = resolve_config(
        parse_config(HF_AUTO),
        world_size=2,
        known={"train_micro_batch_size_per_gpu": 4, "optimizer.params.lr": 1e-4, "hidden_size": 64},
    )
    assert resolve_config(once, world_size=2) == once
    with pytest.raises(ConfigError):
        resolve_config(once, world_size=4)


# --------------------------------------------------------------------------- real-world configs


KNOWN = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer.params.lr": 1e-4,
    "hidden_size": 64,
    "scheduler.params.total_num_steps": 100,
}


def _seed_002() -> dict[str, Any]:
    data: dict[str, Any] = ast.literal_eval((DATA / "seeds" / "seed_002_python_dict.txt").read_text())
    return data


REAL_CONFIGS = [(path.name, path, world) for path in sorted((DATA / "ds_configs").glob("*.json")) for world in (2, 8)]
REAL_CONFIGS += [
    ("seed_000", DATA / "seeds" / "seed_000_stage3_cpu_offload.json", 8),
    ("seed_001", DATA / "seeds" / "seed_001_stage3_fp16_activation_checkpointing.json", 8),
]


@pytest.mark.parametrize(("name", "path", "world"), REAL_CONFIGS, ids=[f"{n}-ws{w}" for n, _, w in REAL_CONFIGS])
def test_real_world_config_parses_and_resolves(name: str, path: pathlib.Path, world: int) -> None:
    cfg = resolve_config(parse_config(path), world_size=world, known=KNOWN)
    assert cfg.resolved
    product = cfg.train_micro_batch_size_per_gpu * cfg.gradient_accumulation_steps * world  # type: ignore[operator]
    assert cfg.train_batch_size == product
    text = json.dumps(cfg.to_dict())
    assert '"auto"' not in text.replace('"keep_in_fp32_modules": "auto"', "")
    assert parse_config(cfg.to_dict()) == cfg


def test_ms_swift_zero3_values() -> None:
    cfg = resolve_config(parse_config(DATA / "ds_configs" / "ms-swift_zero3.json"), world_size=2, known=KNOWN)
    zero = cfg.zero_optimization
    assert (zero.stage, zero.overlap_comm, zero.sub_group_size) == (3, True, 1_000_000_000)
    assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size) == (4096, 3686)
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.steps_per_print) == (8, 1, 2000)
    assert cfg.fp16.enabled is False and cfg.fp16.loss_scale == 0.0 and cfg.gradient_clipping == 1.0


def test_ms_swift_cosine_schedule_needs_total_steps() -> None:
    cfg = parse_config(DATA / "ds_configs" / "ms-swift_zero2_offload.json")
    known = {key: value for key, value in KNOWN.items() if key != "scheduler.params.total_num_steps"}
    with pytest.raises(ConfigError, match=r"^scheduler\.params\.total_num_steps is \"auto\""):
        resolve_config(cfg, world_size=2, known=known)
    out = resolve_config(cfg, world_size=2, known=KNOWN)
    assert out.scheduler is not None and out.scheduler.params == {
        "total_num_steps": 100,
        "warmup_num_steps": 0,
    }
    assert out.zero_optimization.offload_optimizer.device == "cpu"
    assert out.zero_optimization.reduce_bucket_size == 200_000_000


def test_transformers_zero3_legacy_spelling(log: pytest.LogCaptureFixture) -> None:
    cfg = resolve_config(parse_config(DATA / "ds_configs" / "transformers-tests_zero3.json"), world_size=2, known=KNOWN)
    zero = cfg.zero_optimization
    assert zero.stage3_gather_16bit_weights_on_model_save is True and zero.sub_group_size == 10**14
    assert (
        zero.reduce_bucket_size,
        zero.stage3_prefetch_bucket_size,
        zero.stage3_param_persistence_threshold,
    ) == (0, 0, 0)
    assert cfg.fp16.enabled is True and cfg.train_batch_size == 8
    assert cfg.optimizer is not None and cfg.optimizer.params["betas"] == [0.8, 0.999]
    assert any("stage3_gather_fp16_weights_on_model_save is deprecated" in w for w in warnings_of(log))


def test_seed_000_stage3_values() -> None:
    cfg = resolve_config(parse_config(DATA / "seeds" / "seed_000_stage3_cpu_offload.json"), world_size=8, known=KNOWN)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        64,
        1,
        8,
    )
    zero = cfg.zero_optimization
    assert zero.offload_optimizer.buffer_count == 4 and zero.stage3_max_reuse_distance == 10**9
    assert zero.reduce_bucket_size == 4096 and zero.stage3_param_persistence_threshold == 100_000


def test_seed_001_stage3_fp16_activation_checkpointing() -> None:
    cfg = resolve_config(
        parse_config(DATA / "seeds" / "seed_001_stage3_fp16_activation_checkpointing.json"),
        world_size=8,
        known=KNOWN,
    )
    assert cfg.fp16.enabled is True and cfg.activation_checkpointing.partition_activations is False
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 500_000_000
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 1_000_000
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (32, 1)


def test_seed_002_python_dict_with_repeated_key() -> None:
    cfg = resolve_config(parse_config(_seed_002()), world_size=2, known=KNOWN)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        32,
        4,
        4,
    )
    assert cfg.optimizer is not None and (cfg.optimizer.type, cfg.optimizer.params) == ("AdamW", {"lr": 1e-4})
    assert cfg.fp16.enabled is True and cfg.gradient_clipping == 1.0
    assert cfg.zero_optimization.offload_param.device == "cpu"
    with pytest.raises(ConfigError, match="world_size 8"):
        resolve_config(parse_config(_seed_002()), world_size=8, known=KNOWN)


def test_the_config_reads_by_key_as_the_dict_the_script_gave() -> None:
    """DeepSpeed's `engine.config` is the script's dict: OpenRLHF reads
    `engine.config["zero_optimization"]["offload_optimizer"]["device"]`. The keys read what was given ("auto" too);
    the fields hold what the engine uses."""
    given = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    cfg = resolve_config(parse_config(given), world_size=2, known={"train_micro_batch_size_per_gpu": 4})
    assert cfg["zero_optimization"] == {"stage": 2} and cfg["train_micro_batch_size_per_gpu"] == "auto"
    assert cfg.train_micro_batch_size_per_gpu == 4 and cfg.zero_optimization.stage == 2
    assert "bf16" in cfg and "fp16" not in cfg and cfg.get("fp16", "absent") == "absent"
    assert dict(cfg.items()) == given and list(cfg.keys()) == list(given) == list(cfg) and parse_config({})  # truthy
    with pytest.raises(KeyError):
        cfg["fp16"]


def test_hidden_size_autos_without_a_hidden_size_take_deepspeeds_defaults() -> None:
    """OpenRLHF passes "auto" bucket sizes straight to `deepspeed.initialize`, whose zero_optimization block reads
    "auto" as its default (0.19.8: 5e8, 5e7, 1e5); with a hidden size known, the HF Trainer's rules apply."""
    zero = {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "sub_group_size": "auto",
    }
    cfg = resolve_config(parse_config({"train_batch_size": 8, "zero_optimization": zero}), world_size=2)
    z = cfg.zero_optimization
    got = (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold, z.sub_group_size)
    assert got == (500_000_000, 50_000_000, 100_000, 1_000_000_000), got
    known = {"hidden_size": 64}
    z = resolve_config(parse_config({"train_batch_size": 8, "zero_optimization": zero}), world_size=2, known=known)
    assert z.zero_optimization.reduce_bucket_size == 64 * 64
    assert z.zero_optimization.stage3_param_persistence_threshold == 640
