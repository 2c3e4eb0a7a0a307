"""DeepSpeed's ZeRO config classes built from keys (`deepspeed.runtime.zero.config`), DeepSpeed's own
`test_zero_config.py` cases, and the block `DeepSpeedConfig(...).zero_config` read with DeepSpeed's field names."""

from __future__ import annotations

import pytest

from zeroshard.errors import ConfigError
from zeroshard.runtime.config import DeepSpeedConfig
from zeroshard.runtime.zero.config import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)


def test_deprecated_keys_ask_for_offload_blocks() -> None:
    assert isinstance(DeepSpeedZeroConfig(cpu_offload_param=True).offload_param, DeepSpeedZeroOffloadParamConfig)
    assert isinstance(DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save


@pytest.mark.parametrize(
    ("key", "field"),
    [
        ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
        ("stage3_param_persistence_threshold", "param_persistence_threshold"),
        ("stage3_model_persistence_threshold", "model_persistence_threshold"),
        ("stage3_max_live_parameters", "max_live_parameters"),
        ("stage3_max_reuse_distance", "max_reuse_distance"),
        ("stage3_module_granularity_threshold", "module_granularity_threshold"),
    ],
)
def test_deepspeed_field_names(key: str, field: str) -> None:
    assert getattr(DeepSpeedZeroConfig(**{key: 12345}), field) == 12345
    ds_config = DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 3, key: 12345}})
    assert getattr(ds_config.zero_config, field) == 12345


def test_stage_dependent_defaults() -> None:
    for stage in (0, 1, 2):
        config = DeepSpeedZeroConfig(stage=stage)
        assert config.overlap_comm is False and config.pipeline_loading_checkpoint is False
    assert DeepSpeedZeroConfig(stage=3).overlap_comm is True


def test_offload_blocks_are_none_unless_asked_for() -> None:
    for config in (DeepSpeedZeroConfig(), DeepSpeedZeroConfig(offload_param=None, offload_optimizer=None)):
        assert config.offload_param is None and config.offload_optimizer is None
    config = DeepSpeedZeroConfig(offload_param={}, offload_optimizer={})
    assert isinstance(config.offload_param, DeepSpeedZeroOffloadParamConfig)
    assert isinstance(config.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)


def test_offload_optimizer_pipeline() -> None:
    assert DeepSpeedZeroOffloadOptimizerConfig().pipeline is False
    for read, write in ((True, False), (False, True), (True, True)):
        assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_read=read, pipeline_write=write).pipeline is True


def test_a_wrong_key_is_one_line() -> None:
    with pytest.raises(ConfigError, match="stage3_prefetch_bucket_sise") as error:
        DeepSpeedZeroConfig(stage3_prefetch_bucket_sise=1)
    assert "\n" not in str(error.value)


def test_leaf_module_block_as_deepspeed_reads_it() -> None:
    from zeroshard.runtime.zero.leaf_module_config import DEFAULT_LEAF_MODULE_CLASSES, DEFAULT_LEAF_MODULE_NAMES

    config = DeepSpeedZeroConfig()
    assert config.leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES and config.leaf_module.names == []
    assert DEFAULT_LEAF_MODULE_NAMES == []
    one = DeepSpeedZeroConfig(leaf_module={"classes": "my.Class", "names": "sub", "name_suffixes": ["tail", "tail"]})
    assert (one.leaf_module.classes, one.leaf_module.names, one.leaf_module.name_suffixes) == (
        ["my.Class"],
        ["sub"],
        ["tail"],
    )


def test_the_leaf_module_block_marks_what_it_names() -> None:
    from torch import nn

    from zeroshard.config import parse_config
    from zeroshard.utils import z3_leaf_module
    from zeroshard.zero.from_config import leaf_modules

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    cfg = parse_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "leaf_module": {"names": ["1"]}}})
    assert not z3_leaf_module(model[1])
    leaf_modules(cfg, model)  # what a stage-3 engine's build does, as DeepSpeed's initialize marks them
    assert z3_leaf_module(model[1]) and not z3_leaf_module(model[0]) and not z3_leaf_module(model)
