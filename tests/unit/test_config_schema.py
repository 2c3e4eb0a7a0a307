"""Unit tests of the ds_config schema: DeepSpeed's keys and defaults, field docs, module hygiene."""

from __future__ import annotations

import ast
import dataclasses
import doctest
import itertools
import json
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

import zeroshard.config as config_pkg
from helpers.config_checks import CONFIG_DIR
from helpers.deepspeed_reference import import_deepspeed
from zeroshard.config import (
    AUTO,
    ConfigBlock,
    ZeroshardConfig,
    complete_batch,
    parse_config,
    resolve_config,
)
from zeroshard.config import parse as parse_module
from zeroshard.config import resolve as resolve_module
from zeroshard.config import schema as schema_module
from zeroshard.config.fields import default_of, spec_of
from zeroshard.errors import ConfigError

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


# --------------------------------------------------------------------------- DeepSpeed parity


def test_zero_keys_and_defaults_match_deepspeed() -> None:
    theirs_class = import_deepspeed("deepspeed.runtime.zero.config").DeepSpeedZeroConfig
    theirs = theirs_class().model_dump(by_alias=True)
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
    assert set(theirs_class.model_fields) <= set(ZeroshardConfig().zero_optimization.spellings()) | deprecated


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
    theirs = getattr(import_deepspeed(module), name)().model_dump()
    block: Any = parse_config({})
    for part in ours.split("."):
        block = getattr(block, part)
    mine = block.to_dict()
    theirs = {key: (str(value) if key == "nvme_path" and value else value) for key, value in theirs.items()}
    assert set(theirs) == set(mine)
    assert {k: (list(v) if isinstance(v, tuple) else v) for k, v in theirs.items()} == mine


def test_top_level_defaults_match_deepspeed() -> None:
    constants = import_deepspeed("deepspeed.runtime.constants")
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
    ds_config = import_deepspeed("deepspeed.runtime.config")
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


# --------------------------------------------------------------------------- module hygiene


def fn_name_ok(name: str) -> bool:
    """What check_blocks may import: torch (the fsdp2 plan's dtype) and the readers' checks."""
    return name == "torch" or name.startswith("zeroshard.")


def test_config_modules_import_no_torch() -> None:
    allowed_roots = {
        "__future__",
        "base64",  # a config passed as base64-encoded JSON, as DeepSpeed's autotuner passes it
        "binascii",
        "collections",
        "copy",
        "dataclasses",
        "difflib",
        "enum",
        "importlib",  # importlib.util.find_spec("hjson"): whether the error may suggest installing it
        "hjson",  # optional, inside the function that reads a file JSON cannot (DeepSpeed's config files)
        "json",
        "logging",
        "math",
        "os",
        "re",
        "sys",
        "types",
        "typing",
        "zeroshard",
    }
    for source in CONFIG_DIR.glob("*.py"):
        tree = ast.parse(source.read_text())
        # [Note: probing the optimizer]: one function imports zeroshard.optim to build the optimizer and
        # scheduler on a throwaway parameter; [Note: blocks checked by their readers]: one imports the readers'
        # checks; no module-level import leaves the config package.
        probing = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef) and fn.name in ("check_buildable", "check_blocks")
            for node in ast.walk(fn)
        }
        for node in ast.walk(tree):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            for name in names:
                if id(node) in probing and fn_name_ok(name):
                    continue
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
