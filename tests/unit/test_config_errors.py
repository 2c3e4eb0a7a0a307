"""Unit tests of ds_config input errors: unknown keys, types and ranges, deprecated spellings, cross-key rules,
warnings for unimplemented keys (a config's files and base64 strings: test_config_files.py)."""

from __future__ import annotations

from typing import Any

import pytest

import zeroshard.config as config_pkg
from helpers.config_checks import error_of, warnings_of
from zeroshard.config import (
    UNIMPLEMENTED,
    ConfigBlock,
    ZeroshardConfig,
    parse_config,
    unimplemented_settings,
)
from zeroshard.config.fields import spec_of
from zeroshard.config.resolve import canonical_path

# --------------------------------------------------------------------------- unknown keys, types, ranges


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            {"zero_optimization": {"overlap_com": True}},
            "zero_optimization.overlap_com: unknown key; did you mean overlap_comm?",
        ),
        ({"trian_batch_size": 8}, "trian_batch_size: unknown key; did you mean train_batch_size?"),
        (
            {"zero_optimization": {"offload_optimizer": {"devcie": "cpu"}}},
            "zero_optimization.offload_optimizer.devcie: unknown key; did you mean device?",
        ),
        ({"fp16": {"enable": True}}, "fp16.enable: unknown key; did you mean enabled?"),
        ({"optimizer": {"type": "Adam", "param": {}}}, "optimizer.param: unknown key; did you mean params?"),
    ],
)
def test_unknown_key_names_the_path_and_the_closest_key(source: dict[str, Any], message: str) -> None:
    assert error_of(source) == message


def test_unknown_key_lists_valid_keys_when_nothing_is_close() -> None:
    message = error_of({"activation_checkpointing": {"zzz": 1}})
    assert message.startswith("activation_checkpointing.zzz: unknown key; valid keys of activation_checkpointing are:")
    assert "partition_activations" in message and "cpu_checkpointing" in message


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            {"zero_optimization": {"stage": 5}},
            "zero_optimization.stage: 5 is out of range; expected 0, 1, 2 or 3",
        ),
        ({"fp16": {"loss_scale_window": "abc"}}, 'fp16.loss_scale_window: "abc" is not an int'),
        ({"fp16": {"hysteresis": True}}, "fp16.hysteresis: true is not an int"),
        ({"fp16": {"initial_scale_power": 2.5}}, "fp16.initial_scale_power: 2.5 is not an int"),
        ({"fp16": {"enabled": 1}}, "fp16.enabled: 1 is not a bool; use true or false"),
        ({"bf16": {"enabled": "true"}}, 'bf16.enabled: "true" is not a bool; use true or false'),
        ({"gradient_clipping": "abc"}, 'gradient_clipping: "abc" is not a number'),
        ({"gradient_clipping": -1}, "gradient_clipping: -1 is out of range; expected >= 0.0"),
        ({"fp16": {"loss_scale": True}}, "fp16.loss_scale: true is not a number"),
        ({"train_batch_size": 0}, "train_batch_size: 0 is out of range; expected >= 1"),
        (
            {"zero_optimization": {"reduce_bucket_size": -5}},
            "zero_optimization.reduce_bucket_size: -5 is out of range; expected >= 0",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            'zero_optimization.offload_optimizer.device: "gpu" is not one of "none", "cpu", "nvme"',
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}},
            "zero_optimization.offload_optimizer.ratio: 1.5 is out of range; expected <= 1.0",
        ),
        (
            {"communication_data_type": "int8"},
            'communication_data_type: "int8" is not a dtype; expected "fp32", "fp16" or "bf16"',
        ),
        (
            {"checkpoint": {"tag_validation": "loud"}},
            'checkpoint.tag_validation: "loud" is not one of "WARN", "IGNORE", "FAIL"',
        ),
        ({"fp16": 3}, "fp16: 3 is not an object (a mapping of keys to values)"),
        ({"optimizer": {"params": {"lr": 1}}}, "optimizer.type: missing; every optimizer block needs a type"),
        (
            {"optimizer": {"type": "Adam", "params": [1]}},
            "optimizer.params: [1] is not an object (a mapping of keys to values)",
        ),
        ({"comms_logger": {"prof_ops": "all_reduce"}}, 'comms_logger.prof_ops: "all_reduce" is not a list'),
        (
            {"elasticity": {"micro_batch_sizes": [2, "x"]}},
            'elasticity.micro_batch_sizes[1]: "x" is not an int',
        ),
        ({"pipeline": "fast"}, 'pipeline: "fast" is not an object (a mapping of keys to values)'),
    ],
)
def test_wrong_types_and_ranges_name_the_key_and_value(source: dict[str, Any], message: str) -> None:
    assert error_of(source) == message


def test_tag_validation_is_case_insensitive() -> None:
    assert parse_config({"checkpoint": {"tag_validation": "Fail"}}).checkpoint.tag_validation == "FAIL"


def test_source_of_the_wrong_type() -> None:
    assert error_of(42) == "a ds_config is a path to a JSON file, a mapping or base64-encoded JSON, not a int"
    assert error_of({1: 2}) == "ds_config: key 1 is not a string"


# --------------------------------------------------------------------------- deprecated and alternative spell


@pytest.mark.parametrize(
    ("source", "attribute", "value", "warning"),
    [
        (
            {"zero_optimization": {"stage": 2, "cpu_offload": True}},
            "zero_optimization.offload_optimizer.device",
            "cpu",
            "zeroshard: zero_optimization.cpu_offload is deprecated; use "
            "zero_optimization.offload_optimizer.device "
            "instead",
        ),
        (
            {"zero_optimization": {"stage": 3, "cpu_offload_param": True}},
            "zero_optimization.offload_param.device",
            "cpu",
            "zeroshard: zero_optimization.cpu_offload_param is deprecated; use "
            "zero_optimization.offload_param.device instead",
        ),
        (
            {"zero_optimization": {"cpu_offload_use_pin_memory": False}},
            "zero_optimization.offload_param.pin_memory",
            False,
            "zeroshard: zero_optimization.cpu_offload_use_pin_memory is deprecated; use "
            "zero_optimization.offload_optimizer.pin_memory and "
            "zero_optimization.offload_param.pin_memory instead",
        ),
        (
            {"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}},
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
            True,
            "zeroshard: zero_optimization.stage3_gather_fp16_weights_on_model_save is deprecated; use "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save instead",
        ),
        (
            {"bfloat16": {"enabled": True}},
            "bf16.enabled",
            True,
            "zeroshard: bfloat16 is deprecated; use bf16 instead",
        ),
        (
            {"aio": {"thread_count": 4}},
            "aio.intra_op_parallelism",
            4,
            "zeroshard: aio.thread_count is deprecated; use aio.intra_op_parallelism instead",
        ),
        (
            {"bf16": {"check_overflow": False}},
            "bf16.check_grad_overflow",
            False,
            "zeroshard: bf16.check_overflow is deprecated; use bf16.check_grad_overflow instead",
        ),
        (
            {"seq_parallel_comm_data_type": "bf16"},
            "seq_parallel_communication_data_type",
            "bf16",
            "zeroshard: seq_parallel_comm_data_type is deprecated; use seq_parallel_communication_data_type instead",
        ),
        (
            {"zero_optimization": True, "allgather_size": 1e8},
            "zero_optimization.allgather_bucket_size",
            100_000_000,
            "zeroshard: zero_optimization=true/false is deprecated; use zero_optimization.stage instead",
        ),
    ],
)
def test_deprecated_key_warns_and_sets_the_new_key(
    log: pytest.LogCaptureFixture, source: dict[str, Any], attribute: str, value: object, warning: str
) -> None:
    cfg: Any = parse_config(source)
    for part in attribute.split("."):
        cfg = getattr(cfg, part)
    assert cfg == value
    assert warning in warnings_of(log)
    assert [w for w in warnings_of(log) if "deprecated" in w] == [warning]


def test_deprecated_and_new_key_with_different_values_is_an_error() -> None:
    message = error_of({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "none"}}})
    assert message == (
        "zero_optimization.cpu_offload (deprecated) and zero_optimization.offload_optimizer.device "
        'are both set, to different values ("cpu" and "none"); keep only '
        "zero_optimization.offload_optimizer.device"
    )
    message = error_of({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
    assert message.startswith("bfloat16 (deprecated) and bf16 are both set, to different values")
    message = error_of(
        {
            "zero_optimization": {
                "stage3_gather_fp16_weights_on_model_save": True,
                "gather_16bit_weights_on_model_save": False,
            }
        }
    )
    assert message.startswith(
        "zero_optimization.stage3_gather_fp16_weights_on_model_save (deprecated) and "
        "zero_optimization.stage3_gather_16bit_weights_on_model_save are both set"
    )


def test_deprecated_and_new_key_with_the_same_value_is_fine() -> None:
    cfg = parse_config(
        {
            "zero_optimization": {
                "stage": 2,
                "cpu_offload": True,
                "offload_optimizer": {"device": "cpu", "pin_memory": False},
            }
        }
    )
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_optimizer.pin_memory is False
    assert parse_config({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}}).bf16.enabled is True


def test_deepspeed_attribute_names_are_accepted_silently(log: pytest.LogCaptureFixture) -> None:
    cfg = parse_config({"zero_optimization": {"prefetch_bucket_size": 1000, "max_live_parameters": 1e9}})
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 1000
    assert cfg.zero_optimization.stage3_max_live_parameters == 10**9
    assert not [w for w in warnings_of(log) if "deprecated" in w]
    assert error_of({"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}}) == (
        "zero_optimization.prefetch_bucket_size and "
        "zero_optimization.stage3_prefetch_bucket_size are the same "
        "key, given different values (1 and 2); keep one"
    )


# --------------------------------------------------------------------------- cross-key rules


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
            "fp16.enabled and bf16.enabled are both true; enable at most one of them",
        ),
        (
            {"fp16": {"enabled": True, "loss_scale_window": 0}},
            "fp16.loss_scale_window: 0 is out of range; dynamic loss scaling needs > 0",
        ),
        (
            {"zero_optimization": {"stage": 0, "compute_grad_norm": False}},
            "zero_optimization.compute_grad_norm is false, which only "
            "stage 1 or 2 supports (zero_optimization.stage "
            "is 0)",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
            "zero_optimization.offload_optimizer.ratio: 0.5 (partial offload) needs zero_optimization.stage 3 "
            "(it is 2); use ratio 1.0 or remove it",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "ratio": 0}}},
            "zero_optimization.offload_optimizer.ratio: 0.0 (partial offload) needs offload_optimizer.device "
            '"cpu" (it is "nvme"); use ratio 1.0 or remove it',
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 0.25}}},
            "zero_optimization.offload_optimizer.ratio: 0.25 (partial offload) needs offload_optimizer.device "
            '"cpu" (it is "none"); use ratio 1.0 or remove it',
        ),
        (
            {"zero_optimization": {"stage": 3}, "gradient_allreduce_op": "sum"},
            'gradient_allreduce_op "sum" is not supported with zero_optimization.stage 3',
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            'zero_optimization.offload_param.device is "nvme" but offload_param.nvme_path is not set',
        ),
        (
            {"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 1}},
            "bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads to be true",
        ),
        (
            {"bf16": {"bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
            "bf16.bf16_master_weights_and_grads is true but bf16.enabled is false: bf16 master weights need bf16 "
            "training (set bf16.enabled true, or remove bf16_master_weights_and_grads)",
        ),
        (
            {
                "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                "zero_optimization": {"stage": 3},
                "zeroshard": {"backend": "fsdp2"},
            },
            'bf16.bf16_master_weights_and_grads needs the "zero" backend (zeroshard.backend is "fsdp2", whose '
            "sharded parameters are the fp32 masters)",
        ),
        (
            {
                "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}},
            },
            "zero_optimization.offload_optimizer.super_offload: true needs fp32 master weights "
            "(bf16.bf16_master_weights_and_grads is true); set super_offload false or remove it",
        ),
        (
            {"fp16": {"fp16_master_weights_and_grads": True}, "zero_optimization": {"stage": 1}},
            "fp16.fp16_master_weights_and_grads is true but fp16.enabled is false: fp16 master weights need fp16 "
            "training (set fp16.enabled true, or remove fp16_master_weights_and_grads)",
        ),
        (
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
            "bf16.bf16_master_weights_and_grads is true but needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)",
        ),
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "fp16.fp16_master_weights_and_grads is true but needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)",
        ),
    ],
)
def test_contradicting_keys_are_errors(source: dict[str, Any], message: str) -> None:
    assert error_of(source) == message


def test_static_loss_scale_does_not_need_a_window() -> None:
    assert parse_config({"fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}}).fp16.loss_scale == 128


# --------------------------------------------------------------------------- unimplemented keys


def test_unimplemented_is_one_immutable_set_of_real_keys() -> None:
    assert isinstance(UNIMPLEMENTED, frozenset)
    for entry in UNIMPLEMENTED:
        assert canonical_path(entry) == entry, entry
        block: type[ConfigBlock] | None = ZeroshardConfig
        for part in entry.split("."):
            assert block is not None and part in block.key_fields(), entry
            spec = spec_of(block.key_fields()[part])
            block = spec.block_type if spec else None
    for key in (
        "zero_optimization.stage",
        "fp16.enabled",
        "train_batch_size",
        "gradient_clipping",
        "zero_optimization.reduce_bucket_size",
        "communication_data_type",
        "data_types.grad_accum_dtype",
    ):
        assert not config_pkg.is_unimplemented(key), key


def test_non_default_unimplemented_value_warns_once(log: pytest.LogCaptureFixture) -> None:
    parse_config({"zero_optimization": {"stage": 3, "override_module_apply": False}})
    assert warnings_of(log) == [
        "zeroshard: zero_optimization.override_module_apply=false is accepted but not implemented yet; it has no effect"
    ]


def test_a_key_deepspeed_removed_says_so(log: pytest.LogCaptureFixture) -> None:
    """DeepSpeed 0.19.8 refuses these ("has been removed"); an older config still loads here, with one line each."""
    config = {"zero_optimization": {"stage": 1, "mics_shard_size": 8, "legacy_stage1": True}}
    parse_config({**config, "sparse_attention": {"mode": "fixed"}})
    assert sorted(warnings_of(log)) == [
        'zeroshard: sparse_attention={"mode": "fixed"} is a feature DeepSpeed 0.19 removed (DeepSpeed refuses it); '
        "zeroshard accepts it and it has no effect",
        "zeroshard: zero_optimization.legacy_stage1=true is a feature DeepSpeed 0.19 removed (DeepSpeed refuses "
        "it); zeroshard accepts it and it has no effect",
        "zeroshard: zero_optimization.mics_shard_size=8 is a feature DeepSpeed 0.19 removed (DeepSpeed refuses it); "
        "zeroshard accepts it and it has no effect",
    ]


def test_elastic_checkpoint_is_a_no_op_by_design(log: pytest.LogCaptureFixture) -> None:
    """Every zeroshard checkpoint reshards at load, which is what DeepSpeed's elastic layout is for."""
    parse_config({"zero_optimization": {"stage": 2, "elastic_checkpoint": True}})
    assert warnings_of(log) == []


def test_quantized_nontrainable_weights_work_at_stage_3_and_are_ignored_below(log: pytest.LogCaptureFixture) -> None:
    """[Note: quantized frozen weights]: no "not implemented" line at stage 3; DeepSpeed's warning-free ignore below
    it becomes one line here, as for the other ZeRO++ keys."""
    parse_config({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}})
    assert warnings_of(log) == []
    parse_config({"zero_optimization": {"stage": 2, "zero_quantized_nontrainable_weights": True}})
    assert warnings_of(log) == [
        "zeroshard: zero_optimization.zero_quantized_nontrainable_weights (ZeRO++) is ignored at "
        "zero_optimization.stage 2, as DeepSpeed ignores it: ZeRO++ works on stage 3's parameter shards and gathers "
        "and its gradient reduction"
    ]


def test_default_and_auto_values_never_warn(log: pytest.LogCaptureFixture) -> None:
    parse_config(
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "none", "pin_memory": True},
                "sub_group_size": 1e9,
                "stage3_max_live_parameters": "auto",
                "stage3_param_persistence_threshold": "auto",
                "zero_hpz_partition_size": 1,
            },
            "activation_checkpointing": {"partition_activations": False},
            "tensorboard": {"enabled": False},
        }
    )
    assert warnings_of(log) == []


def test_unimplemented_blocks_warn_per_key(log: pytest.LogCaptureFixture) -> None:
    cfg = parse_config(
        {
            "hybrid_engine": {"enabled": True, "max_out_tokens": 8, "inference_tp_size": 2, "enable_cuda_graph": True},
            "datastates_ckpt": {"enabled": True},
            "zero_optimization": {"mics_shard_size": 8},
        }
    )
    assert list(unimplemented_settings(cfg)) == [  # hybrid_engine's implemented keys do not warn
        ("zero_optimization.mics_shard_size", 8),
        ("datastates_ckpt", {"enabled": True}),
        ("hybrid_engine.inference_tp_size", 2),
        ("hybrid_engine.enable_cuda_graph", True),
    ]
    assert warnings_of(log)[-1] == (
        "zeroshard: hybrid_engine.enable_cuda_graph=true is accepted but not implemented yet; it has no effect"
    )
    assert len(warnings_of(log)) == 4


def test_zeropp_keys_with_the_fsdp2_backend_get_its_refusal_not_the_stage_warning(
    log: pytest.LogCaptureFixture,
) -> None:
    """fsdp2/plan.py refuses ZeRO++ keys at any stage: the "ignored at stage 2" line would contradict that."""
    parse_config({"zeroshard": {"backend": "fsdp2"}, "zero_optimization": {"stage": 2, "zero_quantized_weights": True}})
    assert warnings_of(log) == []


def test_a_vocabulary_size_off_a_multiple_of_8_gets_deepspeeds_hint(log: pytest.LogCaptureFixture) -> None:
    parse_config({"vocabulary_size": 50257})
    assert warnings_of(log) == [
        "zeroshard: vocabulary_size 50257 is not a multiple of 8: an embedding padded to one uses tensor cores better "
        "(the key changes nothing else, as in DeepSpeed)"
    ]
    parse_config({"vocabulary_size": 50304})
    assert len(warnings_of(log)) == 1
