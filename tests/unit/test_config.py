"""Unit tests of the ds_config schema: parsing, aliases, "auto" resolution, batch math, warnings."""

from __future__ import annotations

import ast
import dataclasses
import doctest
import itertools
import json
import logging
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

import zeroshard.config as config_pkg
from zeroshard.config import (
    AUTO,
    UNIMPLEMENTED,
    ConfigBlock,
    ZeroshardConfig,
    complete_batch,
    parse_config,
    resolve_config,
    unimplemented_settings,
)
from zeroshard.config import parse as parse_module
from zeroshard.config import resolve as resolve_module
from zeroshard.config import schema as schema_module
from zeroshard.config.fields import default_of, spec_of
from zeroshard.config.resolve import canonical_path
from zeroshard.errors import ConfigError
from zeroshard.utils.logging import get_logger

DATA = pathlib.Path(__file__).parent / "data"
CONFIG_DIR = pathlib.Path(config_pkg.__file__).parent


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture the zeroshard logger (it does not propagate to the root logger)."""
    logger = get_logger()
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="zeroshard")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def error_of(source: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(source)
    return str(info.value)


# --------------------------------------------------------------------------- defaults and shape


def test_empty_config_has_deepspeed_defaults() -> None:
    cfg = parse_config({})
    assert cfg.train_batch_size is None and cfg.gradient_accumulation_steps is None
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print is None
    assert cfg.prescale_gradients is False and cfg.gradient_predivide_factor == 1.0
    assert cfg.communication_data_type is None and cfg.data_types.grad_accum_dtype is None
    assert cfg.optimizer is None and cfg.scheduler is None
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window) == (
        False,
        0.0,
        16,
        1000,
    )
    assert (fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale, fp16.auto_cast) == (
        2,
        False,
        1,
        False,
    )
    zero = cfg.zero_optimization
    assert zero.stage == 0 and zero.reduce_bucket_size == 500_000_000 and zero.allgather_bucket_size == 500_000_000
    assert isinstance(zero.reduce_bucket_size, int)
    assert zero.offload_optimizer.device == "none" and zero.offload_param.device == "none"
    assert zero.overlap_comm is False
    assert cfg.aio.block_size == 1_048_576 and cfg.checkpoint.tag_validation == "WARN"
    assert cfg.activation_checkpointing.partition_activations is False and cfg.elasticity.enabled is False
    assert cfg.tensorboard.job_name == "DeepSpeedJobName" and cfg.wandb.project == "deepspeed"
    assert cfg.flops_profiler.profile_step == 1 and cfg.comms_logger.prof_all is True


def _blocks(cls: type[ConfigBlock]) -> Iterator[type[ConfigBlock]]:
    yield cls
    for f in cls.key_fields().values():
        spec = spec_of(f)
        if spec is not None and spec.block_type is not None:
            yield from _blocks(spec.block_type)


ALL_BLOCKS: list[type[ConfigBlock]] = sorted(set(_blocks(ZeroshardConfig)), key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", ALL_BLOCKS, ids=[c.__name__ for c in ALL_BLOCKS])
def test_every_field_has_a_doc(cls: type[ConfigBlock]) -> None:
    for name, f in cls.key_fields().items():
        assert f.metadata.get("doc"), f"{cls.__name__}.{name} has no doc"


def test_config_is_frozen() -> None:
    cfg = parse_config({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gradient_clipping = 0.0  # type: ignore[misc]


def test_sizes_written_as_floats_become_ints() -> None:
    cfg = parse_config({"zero_optimization": {"allgather_bucket_size": 2e8, "sub_group_size": 1e14}})
    zero = cfg.zero_optimization
    assert zero.allgather_bucket_size == 200_000_000 and type(zero.allgather_bucket_size) is int
    assert zero.sub_group_size == 10**14 and type(zero.sub_group_size) is int


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("float32", "fp32"),
        ("fp32", "fp32"),
        ("FP16", "fp16"),
        ("half", "fp16"),
        ("bfloat16", "bf16"),
        ("torch.bfloat16", "bf16"),
        (None, None),
    ],
)
def test_dtype_spellings_are_normalised(given: str | None, expected: str | None) -> None:
    cfg = parse_config({"communication_data_type": given, "data_types": {"grad_accum_dtype": given}})
    assert cfg.communication_data_type == expected and cfg.data_types.grad_accum_dtype == expected


def test_overlap_comm_default_depends_on_stage() -> None:
    assert parse_config({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    assert parse_config({"zero_optimization": {"stage": 2}}).zero_optimization.overlap_comm is False
    explicit = {"zero_optimization": {"stage": 3, "overlap_comm": False}}
    assert parse_config(explicit).zero_optimization.overlap_comm is False


def test_overlap_comm_auto_follows_the_stage() -> None:
    cfg = parse_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "overlap_comm": "auto"}})
    assert cfg.zero_optimization.overlap_comm is AUTO
    assert resolve_config(cfg, world_size=1).zero_optimization.overlap_comm is True


def test_optimizer_and_scheduler_blocks() -> None:
    cfg = parse_config(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        }
    )
    assert cfg.optimizer is not None and cfg.optimizer.type == "AdamW"
    assert cfg.optimizer.params == {"lr": 1e-3, "betas": [0.9, 0.95]}
    assert cfg.scheduler is not None and cfg.scheduler.params == {"warmup_num_steps": 10}
    assert parse_config({"optimizer": None}).optimizer is None


def test_raw_keeps_the_users_mapping() -> None:
    user: dict[str, Any] = {
        "zero_optimization": {"stage": 2, "cpu_offload": True},
        "train_batch_size": "auto",
    }
    cfg = parse_config(user)
    user["zero_optimization"]["stage"] = 1
    assert cfg.raw == {"zero_optimization": {"stage": 2, "cpu_offload": True}, "train_batch_size": "auto"}
    assert cfg.zero_optimization.stage == 2


def test_to_dict_is_json_and_round_trips() -> None:
    cfg = parse_config(
        {
            "fp16": {"enabled": "auto"},
            "optimizer": {"type": "Adam", "params": {"lr": "auto"}},
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 2e8},
        }
    )
    full = cfg.to_dict()
    json.dumps(full)
    assert full["fp16"]["enabled"] == "auto" and full["optimizer"]["params"]["lr"] == "auto"
    assert parse_config(full) == cfg
    short = cfg.to_dict(include_defaults=False)
    assert short == {
        "fp16": {"enabled": "auto"},
        "optimizer": {"type": "Adam", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 200_000_000},
    }


def test_parse_accepts_a_path_and_a_config(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    cfg = parse_config(path)
    assert cfg.train_batch_size == 8 and parse_config(str(path)) == cfg
    assert parse_config(cfg) is cfg


def test_every_deepspeed_top_level_key_is_accepted() -> None:
    keys = [
        "amp",
        "sparse_gradients",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "dump_state",
        "memory_breakdown",
        "dataloader_drop_last",
        "data_efficiency",
        "curriculum_learning",
        "compression_training",
        "autotuning",
        "pipeline",
        "eigenvalue",
        "progressive_layer_drop",
        "sparse_attention",
        "nebula",
        "hybrid_engine",
        "torch_autocast",
        "compile",
        "timers",
        "zero_allow_comm_data_type_fp32",
        "seq_parallel_communication_data_type",
        "use_data_before_expert_parallelism",
        "graph_harvesting",
        "checkpoint",
        "tensor_parallel",
        "expert_parallel",
        "weight_quantization",
        "datastates_ckpt",
        "data_types",
        "aio",
        "elasticity",
        "comet",
        "log_level",
        "disable_python_gc",
        "disable_allgather",
        "vocabulary_size",
        "managed_gradient_accumulation",
        "gradient_allreduce_op",
        "sequence_parallel_size",
        "flops_profiler",
    ]
    accepted = set(ZeroshardConfig.spellings())
    assert not [key for key in keys if key not in accepted]


# --------------------------------------------------------------------------- DeepSpeed parity (optional)


def _deepspeed() -> Any:
    return pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is not installed")


def test_zero_keys_and_defaults_match_deepspeed() -> None:
    _deepspeed()
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    theirs = DeepSpeedZeroConfig().model_dump(by_alias=True)
    ours = parse_config({}).zero_optimization.to_dict()
    deprecated = {
        "cpu_offload",
        "cpu_offload_param",
        "cpu_offload_use_pin_memory",
        "stage3_gather_fp16_weights_on_model_save",
    }
    assert set(theirs) - deprecated <= set(ours)
    for key, value in theirs.items():
        if key in deprecated or value is None:  # offload blocks: None there, device "none" here
            continue
        expected = list(value.values()) if key == "leaf_module" else value
        got = list(ours[key].values()) if key == "leaf_module" else ours[key]
        assert got == expected, key
    assert set(DeepSpeedZeroConfig.model_fields) <= set(ZeroshardConfig().zero_optimization.spellings()) | deprecated


@pytest.mark.parametrize(
    ("ours", "module", "name"),
    [
        (
            "zero_optimization.offload_param",
            "deepspeed.runtime.zero.offload_config",
            "DeepSpeedZeroOffloadParamConfig",
        ),
        (
            "zero_optimization.offload_optimizer",
            "deepspeed.runtime.zero.offload_config",
            "DeepSpeedZeroOffloadOptimizerConfig",
        ),
        ("fp16", "deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
        ("bf16", "deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
        ("tensorboard", "deepspeed.monitor.config", "TensorBoardConfig"),
        ("wandb", "deepspeed.monitor.config", "WandbConfig"),
        ("csv_monitor", "deepspeed.monitor.config", "CSVConfig"),
        ("comet", "deepspeed.monitor.config", "CometConfig"),
        ("comms_logger", "deepspeed.comm.config", "CommsLoggerConfig"),
        ("hybrid_engine", "deepspeed.runtime.config", "HybridEngineConfig"),
        ("compile", "deepspeed.compile.config", "CompileConfig"),
        ("timers.throughput", "deepspeed.utils.config", "DeepSpeedThroughputTimerConfig"),
    ],
)
def test_pydantic_blocks_match_deepspeed(ours: str, module: str, name: str) -> None:
    _deepspeed()
    import importlib

    theirs = getattr(importlib.import_module(module), name)().model_dump()
    block: Any = parse_config({})
    for part in ours.split("."):
        block = getattr(block, part)
    mine = block.to_dict()
    theirs = {key: (str(value) if key == "nvme_path" and value else value) for key, value in theirs.items()}
    assert set(theirs) == set(mine)
    assert {k: (list(v) if isinstance(v, tuple) else v) for k, v in theirs.items()} == mine


def test_top_level_defaults_match_deepspeed() -> None:
    constants = pytest.importorskip("deepspeed.runtime.constants")
    cfg = parse_config({})
    pairs = {
        "gradient_clipping": constants.GRADIENT_CLIPPING_DEFAULT,
        "steps_per_print": constants.STEPS_PER_PRINT_DEFAULT,
        "prescale_gradients": constants.PRESCALE_GRADIENTS_DEFAULT,
        "gradient_predivide_factor": constants.GRADIENT_PREDIVIDE_FACTOR_DEFAULT,
        "gradient_allreduce_op": constants.GRADIENT_ALLREDUCE_OP_DEFAULT,
        "communication_data_type": constants.COMMUNICATION_DATA_TYPE_DEFAULT,
        "zero_allow_untested_optimizer": constants.ZERO_ALLOW_UNTESTED_OPTIMIZER_DEFAULT,
        "zero_force_ds_cpu_optimizer": constants.ZERO_FORCE_DS_CPU_OPTIMIZER_DEFAULT,
        "wall_clock_breakdown": constants.WALL_CLOCK_BREAKDOWN_DEFAULT,
        "memory_breakdown": constants.MEMORY_BREAKDOWN_DEFAULT,
        "dataloader_drop_last": constants.DATALOADER_DROP_LAST_DEFAULT,
        "managed_gradient_accumulation": constants.MANAGED_GRADIENT_ACCUMULATION_DEFAULT,
        "disable_allgather": constants.DISABLE_ALLGATHER_DEFAULT,
        "dump_state": constants.DUMP_STATE_DEFAULT,
    }
    assert {key: getattr(cfg, key) for key in pairs} == pairs


def test_batch_rules_match_deepspeed() -> None:
    ds_config = _deepspeed()
    from types import SimpleNamespace

    for train, micro, accum, world in itertools.product(
        (None, 8, 16, 32, 33), (None, 1, 4, 16, 17), (None, 1, 2, 4), (1, 2, 8)
    ):
        theirs = SimpleNamespace(
            train_batch_size=train,
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=accum,
            world_size=world,
        )
        try:
            ds_config.DeepSpeedConfig._set_batch_related_parameters(theirs)
            ds_config.DeepSpeedConfig._batch_assertion(theirs)
            expected: tuple[int, int, int] | None = (
                theirs.train_batch_size,
                theirs.train_micro_batch_size_per_gpu,
                theirs.gradient_accumulation_steps,
            )
        except AssertionError:
            expected = None
        try:
            sizes = complete_batch(train, micro, accum, world)
            got: tuple[int, int, int] | None = dataclasses.astuple(sizes)
        except ConfigError:
            got = None
        assert got == expected, (train, micro, accum, world)


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
    assert error_of(42) == "a ds_config is a path to a JSON file or a mapping, not a int"
    assert error_of({1: 2}) == "ds_config: key 1 is not a string"


# --------------------------------------------------------------------------- JSON files


def test_missing_file_names_the_file(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.json"
    assert error_of(missing) == f"ds_config file {missing} does not exist"


def test_bad_json_names_file_line_and_column(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    message = error_of(path)
    assert message.startswith(f"ds_config file {path} is not valid JSON: ")
    assert "at line 3 column" in message


def test_json_that_is_not_an_object(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert error_of(path) == f"ds_config file {path} holds a JSON list, not an object"


def test_directory_is_not_a_config(tmp_path: pathlib.Path) -> None:
    assert error_of(tmp_path).startswith(f"ds_config file {tmp_path} cannot be read")


def test_duplicate_json_keys(tmp_path: pathlib.Path, log: pytest.LogCaptureFixture) -> None:
    same = tmp_path / "same.json"
    same.write_text('{"gradient_accumulation_steps": 4, "gradient_accumulation_steps": 4}')
    assert parse_config(same).gradient_accumulation_steps == 4
    assert warnings_of(log) == [
        f'zeroshard: key "gradient_accumulation_steps" appears twice in {same} with the same value'
    ]
    different = tmp_path / "different.json"
    different.write_text('{"zero_optimization": {"stage": 1, "stage": 2}}')
    assert error_of(different) == f'ds_config file {different}: key "stage" appears twice, with 1 and 2; keep one'


# --------------------------------------------------------------------------- deprecated and alternative spell


@pytest.mark.parametrize(
    ("source", "attribute", "value", "warning"),
    [
        (
            {"zero_optimization": {"cpu_offload": True}},
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
            "zero_optimization.offload_optimizer.ratio 0.5 < 1.0 (partial offload) needs stage 3 "
            "(zero_optimization.stage is 2)",
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
    parse_config({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}})
    assert warnings_of(log) == [
        "zeroshard: zero_optimization.zero_quantized_weights=true is accepted but not implemented yet; it has no effect"
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
            "tensorboard": {"enabled": True, "output_path": "runs"},
            "autotuning": {"enabled": True},
            "zero_optimization": {"zero_hpz_partition_size": 8},
        }
    )
    assert list(unimplemented_settings(cfg)) == [
        ("zero_optimization.zero_hpz_partition_size", 8),
        ("tensorboard.enabled", True),
        ("tensorboard.output_path", "runs"),
        ("autotuning", {"enabled": True}),
    ]
    assert warnings_of(log)[-1] == (
        'zeroshard: autotuning={"enabled": true} is accepted but not implemented yet; it has no effect'
    )
    assert len(warnings_of(log)) == 4


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
            "none of train_batch_size and train_micro_batch_size_per_gpu is set (set one of them, or "
            "pass train_micro_batch_size_per_gpu to initialize); gradient_accumulation_steps alone does "
            "not fix the batch size",
        ),
        (
            None,
            None,
            None,
            "none of train_batch_size and train_micro_batch_size_per_gpu is set (set one of them, or "
            "pass train_micro_batch_size_per_gpu to initialize); gradient_accumulation_steps alone "
            "does not fix the batch size",
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
        "4 * world_size 8 (= 128) (train_micro_batch_size_per_gpu passed to initialize)"
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
            "scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": "auto"}},
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
            'optimizer.params.lr is "auto" and nothing resolved it; set a '
            "number in the config or pass it to initialize",
        ),
        (
            {
                "train_batch_size": 8,
                "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
            },
            {},
            'scheduler.params.total_num_steps is "auto" and nothing '
            "resolved it; set a number in the config or pass it "
            "to initialize",
        ),
        (
            HF_AUTO,
            {"train_micro_batch_size_per_gpu": 4, "optimizer.params.lr": 1e-4},
            'zero_optimization.reduce_bucket_size is "auto" and depends on '
            "the model's hidden size; pass hidden_size "
            "to initialize or set a number in the config",
        ),
        (
            {"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
            {},
            'scheduler.params.warmup_max_lr is "auto" and follows '
            "optimizer.params.lr, which nothing resolved; set a "
            "number in the config or pass optimizer.params.lr to initialize",
        ),
        (
            {"train_batch_size": "auto", "gradient_accumulation_steps": "auto"},
            {},
            "none of train_batch_size and train_micro_batch_size_per_gpu is set (set one of them, or pass "
            "train_micro_batch_size_per_gpu to initialize); "
            "gradient_accumulation_steps alone does not fix the batch size",
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


# --------------------------------------------------------------------------- module hygiene


def test_config_modules_import_no_torch() -> None:
    allowed_roots = {
        "__future__",
        "collections",
        "copy",
        "dataclasses",
        "difflib",
        "enum",
        "json",
        "logging",
        "math",
        "os",
        "sys",
        "types",
        "typing",
        "zeroshard",
    }
    for source in CONFIG_DIR.glob("*.py"):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            for name in names:
                assert name.split(".")[0] in allowed_roots, f"{source.name} imports {name}"
                if name.startswith("zeroshard."):
                    assert name.startswith(("zeroshard.config", "zeroshard.errors", "zeroshard.utils.logging")), name


@pytest.mark.parametrize("module", [config_pkg, parse_module, resolve_module, schema_module], ids=lambda m: m.__name__)
def test_docstring_examples_run(module: Any) -> None:
    result = doctest.testmod(module, verbose=False)
    assert result.failed == 0 and result.attempted > 0


def test_field_defaults_pass_their_own_checks() -> None:
    for cls in ALL_BLOCKS:
        for name, f in cls.key_fields().items():
            spec = spec_of(f)
            default = default_of(f)
            if (
                spec is not None
                and spec.check is not None
                and default is not None
                and not (cls.REQUIRED and name in cls.REQUIRED)
            ):
                assert spec.check(default, name) == default, (cls.__name__, name)
