"""`deepspeed.runtime.config.DeepSpeedConfig` ([Note: DeepSpeedConfig] in runtime/ds_config.py) against DeepSpeed
0.19.8's own class over the configs of the engine-accessor test: every attribute
DeepSpeed sets is set; scalars are equal; blocks agree on the fields scripts read. And DeepSpeed's monitor test:
monitors built from `monitor_config`'s blocks, `DeepSpeedMonitorConfig()`'s defaults."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine_settings import CONFIGS, _plain

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.errors import ConfigError
from zeroshard.monitor.config import DeepSpeedMonitorConfig
from zeroshard.runtime.config import DeepSpeedConfig

# blocks: compared by these fields (DeepSpeed's are pydantic objects, zeroshard's its own config blocks)
BLOCK_FIELDS = {
    "zero_config": ("stage", "overlap_comm", "reduce_bucket_size", "contiguous_gradients", "sub_group_size"),
    "float16_config": ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis"),
    "bfloat16_config": ("enabled",),
    "activation_checkpointing_config": ("partition_activations", "cpu_checkpointing", "number_checkpoints"),
    "flops_profiler_config": ("enabled", "profile_step", "module_depth", "top_modules", "detailed"),
    "hybrid_engine": ("enabled", "max_out_tokens", "inference_tp_size"),
}
# DeepSpeed's parsed-only blocks, given as the blocks (None when absent): compared by presence of the block only
AS_GIVEN = {
    "autotuning_config",
    "pipeline",
    "datastates_config",
    "checkpoint_config",
    "compile_config",
    "timers_config",
    "tensor_parallel_config",
    "expert_parallel_config",
    "comms_config",
    "monitor_config",
    "weight_quantization_config",
    "data_efficiency_config",
    "aio_config",
}


# (the real-world ds_configs hold "auto" values, which DeepSpeed's class refuses: the HF Trainer fills them)
ALL = CONFIGS


@pytest.mark.parametrize("name", list(ALL))
def test_attributes_are_deepspeeds(name: str) -> None:
    config = ALL[name]
    try:
        theirs = import_deepspeed("deepspeed.runtime.config").DeepSpeedConfig(json.loads(json.dumps(config)))
    except Exception as err:  # noqa: BLE001 - a config DeepSpeed refuses is not compared
        pytest.skip(f"DeepSpeed refuses it: {type(err).__name__}")
    try:
        ours = DeepSpeedConfig(json.loads(json.dumps(config)))
    except ConfigError as err:
        pytest.skip(f"zeroshard refuses it in one line: {err}")
    missing = sorted(set(vars(theirs)) - set(vars(ours)))
    assert not missing, missing
    differences = []
    for key, expected in vars(theirs).items():
        got = getattr(ours, key)
        if key in BLOCK_FIELDS:
            for field in BLOCK_FIELDS[key]:
                if _plain(getattr(got, field)) != _plain(getattr(expected, field)):
                    differences.append(f"{key}.{field}: {getattr(got, field)!r} vs {getattr(expected, field)!r}")
        elif key not in AS_GIVEN and key != "_param_dict" and _plain(got) != _plain(expected):
            differences.append(f"{key}: zeroshard {got!r}, DeepSpeed {expected!r}")
    assert not differences, "\n".join(differences)


def test_monitor_blocks_and_defaults_as_deepspeeds_monitor_test() -> None:
    cfg = DeepSpeedConfig(
        {"train_batch_size": 2, "tensorboard": {"enabled": True, "output_path": "out/", "job_name": "test"}}
    )
    block = cfg.monitor_config.tensorboard
    assert (block.enabled, block.output_path, block.job_name) == (True, "out/", "test") and cfg.monitor_config.enabled
    defaults = DeepSpeedMonitorConfig()
    theirs = import_deepspeed("deepspeed.monitor.config").DeepSpeedMonitorConfig()
    for name in ("tensorboard", "wandb", "csv_monitor", "comet"):
        for field in ("enabled", "output_path", "job_name", "group", "team", "project", "samples_log_interval"):
            if hasattr(getattr(theirs, name), field):
                assert getattr(getattr(defaults, name), field) == getattr(getattr(theirs, name), field), (name, field)
    assert DeepSpeedConfig({"train_batch_size": 2, "wandb": {}}).monitor_config.wandb == defaults.wandb


def test_batch_triple_and_refusals() -> None:
    assert DeepSpeedConfig({"train_micro_batch_size_per_gpu": 3}).train_batch_size == 3
    assert (
        DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2}).train_micro_batch_size_per_gpu == 4
    )
    with pytest.raises(ConfigError):
        DeepSpeedConfig({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1})
    with pytest.raises(ConfigError, match="zero_optimizaton"):
        DeepSpeedConfig({"train_batch_size": 8, "zero_optimizaton": {"stage": 2}})
    assert DeepSpeedConfig({"train_batch_size": 2, "bf16": {"enabled": True}}).bfloat16_config.enabled
    topo = {"train_batch_size": 2, "use_data_before_expert_parallelism": True}  # DeepSpeed's top-level key
    theirs = import_deepspeed("deepspeed.runtime.config").DeepSpeedConfig(dict(topo))
    assert DeepSpeedConfig(topo).use_data_before_expert_parallel_ is theirs.use_data_before_expert_parallel_ is True
    assert DeepSpeedConfig({"train_batch_size": 2, "communication_data_type": "bf16"}).communication_data_type == (
        torch.bfloat16
    )
