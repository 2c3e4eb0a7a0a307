"""DeepSpeed's configuration accessors ([Note: DeepSpeed's configuration accessors] in engine_settings.py): each
answers as DeepSpeed 0.19.8's method of the same name does, for the same ds_config."""

from __future__ import annotations

import enum
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.config import parse_config
from zeroshard.engine_settings import DeepSpeedSettings

CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2},
    # the flops profiler turns the wall-clock breakdown on in DeepSpeed's config
    "flops_profiler_only": {"train_batch_size": 8, "flops_profiler": {"enabled": True}},
    "stage3_offload_fp16": {
        "train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 50, "hysteresis": 3},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "ratio": 0.5, "pin_memory": False},
            "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
            "stage3_prefetch_bucket_size": 1234,
            "stage3_param_persistence_threshold": 99,
            "stage3_max_live_parameters": 5000,
            "stage3_max_reuse_distance": 6000,
            "stage3_module_granularity_threshold": 7,
            "sub_group_size": 4096,
            "zero_hpz_partition_size": 1,
            "zero_quantized_weights": True,
        },
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
        "steps_per_print": 7,
        "wall_clock_breakdown": True,
        "flops_profiler": {"enabled": True, "profile_step": 3, "module_depth": 2, "top_modules": 4, "detailed": False},
        "checkpoint": {"tag_validation": "FAIL", "load_universal": True},
        "prescale_gradients": True,
        "gradient_predivide_factor": 2.0,
    },
    "stage2_bf16": {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": False,
            "reduce_bucket_size": 1000,
            "allgather_bucket_size": 2000,
            "round_robin_gradients": True,
            "contiguous_gradients": False,
            "reduce_scatter": False,
            "offload_optimizer": {"device": "none"},
            "ignore_unused_parameters": False,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.8, 0.9]}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "checkpoint": {"tag_validation": "Ignore", "use_node_local_storage": True},
        "dataloader_drop_last": True,
        "memory_breakdown": True,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    },
    "stage1_autocast_autotuning": {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 3,
        "zero_optimization": {"stage": 1},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": ["torch.nn.Linear"]},
        "autotuning": {"enabled": True, "metric": "latency", "start_profile_step": 2, "end_profile_step": 4},
        "fp16": {"enabled": False, "loss_scale": 64},
        "log_level": "info",
    },
    "legacy_switch_and_bare_blocks": {
        "train_batch_size": 2,
        "zero_optimization": True,  # the legacy switch: stage 1
        "optimizer": {"type": "Adam"},
        "scheduler": {"type": "WarmupLR"},
    },
    "stage2_nvme_null_param_block": {
        "train_batch_size": 2,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "cpuadam_cores_perc": 0.5},
            "offload_param": None,
        },
        "compile": {"deepcompile": True, "passes": ["z1"]},
    },
    "stage3_nvme_optimizer_fp16_static": {
        "train_batch_size": 2,
        "fp16": {"enabled": True, "loss_scale": 128},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
    },
}

# scalar answers, compared as values
SCALARS = [
    "zero_allgather_bucket_size",
    "zero_allgather_partitions",
    "zero_allgather_sequential",
    "zero_allow_untested_optimizer",
    "zero_compute_grad_norm",
    "zero_contiguous_gradients",
    "zero_elastic_checkpoint",
    "zero_force_ds_cpu_optimizer",
    "zero_hpz_partition_size",
    "zero_ignore_unused_parameters",
    "zero_legacy_stage1",
    "zero_load_from_fp32_weights",
    "zero_log_trace_cache_warnings",
    "zero_max_live_parameters",
    "zero_max_reuse_distance",
    "zero_model_persistence_threshold",
    "zero_module_granularity_threshold",
    "zero_multi_rank_bucket_allreduce",
    "zero_overlap_comm",
    "zero_param_persistence_threshold",
    "zero_parameter_alignment",
    "zero_prefetch_bucket_size",
    "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_weights",
    "zero_reduce_bucket_size",
    "zero_reduce_scatter",
    "zero_round_robin_gradients",
    "zero_save_muon_momentum_buffer_in_memory",
    "zero_sub_group_size",
    "zero_cpu_offload",
    "zero_use_cpu_optimizer",
    "zero_partial_offload",
    "zero_optimization_partition_gradients",
    "zero_optimization_partition_weights",
    "is_first_weights_partition_group",
    "is_sanity_checks_enabled",
    "super_offload",
    "zenflow_config",
    "fp16_master_weights_and_gradients",
    "bf16_master_weights_and_gradients",
    "bf16_optimizer_states",
    "torch_autocast_enabled",
    "torch_autocast_dtype",
    "torch_autocast_lower_precision_safe_modules",
    "dynamic_loss_scale",
    "initial_dynamic_scale",
    "dynamic_loss_scale_args",
    "get_data_types",
    "gradient_predivide_factor",
    "postscale_gradients",
    "steps_per_print",
    "wall_clock_breakdown",
    "memory_breakdown",
    "dump_state",
    "log_level",
    "dataloader_drop_last",
    "load_universal_checkpoint",
    "use_node_local_storage",
    "checkpoint_serialization_enabled",
    "checkpoint_tag_validation_enabled",
    "checkpoint_tag_validation_fail",
    "checkpoint_writer_enabled",
    "aio_config",
    "autotp_size",
    "optimizer_legacy_fusion",
    "optimizer_params",
    "scheduler_name",
    "scheduler_params",
    "flops_profiler_enabled",
    "flops_profiler_detailed",
    "flops_profiler_module_depth",
    "flops_profiler_output_file",
    "flops_profiler_profile_step",
    "flops_profiler_recompute_fwd_factor",
    "flops_profiler_top_modules",
    "autotuning_enabled",
    "autotuning_metric",
    "autotuning_start_profile_step",
    "autotuning_end_profile_step",
    "autotuning_metric_path",
    "autotuning_model_info_path",
    "data_efficiency_enabled",
    "data_sampling_enabled",
    "curriculum_learning_enabled",
    "random_ltd_enabled",
    "is_deepcompile_enabled",
    "compile_autosp",
    "compile_autotp",
    "uses_parallelization_pass_only",
    "is_deepcompile_active",
    "cpuadam_cores_perc",
    "get_compile_time",
]
# DeepSpeed raises TypeError without `compile.passes`; zeroshard answers False there, and as DeepSpeed with them
RAISING_IN_DEEPSPEED = ["compile_zero_optimization_stage"]
# blocks zeroshard reports as given (DeepSpeed fills in its defaults): compared by their `enabled`
ENABLED_OF = ["data_efficiency_config", "data_sampling_config", "curriculum_learning_config", "random_ltd_config"]
# DeepSpeed answers with an `and` chain's last operand (None, {}): compared as truth values
TRUTH_VALUES = ["autotuning_profile_model_info"]
# answers that are a block: compared by the fields scripts read
BLOCKS = {"zero_offload_optimizer": ("device", "pin_memory", "ratio"), "zero_offload_param": ("device", "pin_memory")}


class _Settings(DeepSpeedSettings):
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = parse_config(config)
        self.basic_optimizer = None
        self.accumulation = SimpleNamespace(gradient_accumulation_steps=self.config.gradient_accumulation_steps)


def _deepspeed(config: dict[str, Any]) -> Any:
    """DeepSpeed's engine methods over its parsed config, without building an engine (they read `_config` only)."""
    engine_cls = import_deepspeed("deepspeed.runtime.engine").DeepSpeedEngine
    parsed = import_deepspeed("deepspeed.runtime.config").DeepSpeedConfig(config)
    engine = engine_cls.__new__(engine_cls)
    object.__setattr__(engine, "_config", parsed)
    return engine


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("name", list(CONFIGS))
def test_accessors_answer_as_deepspeeds(name):
    ours, theirs = _Settings(CONFIGS[name]), _deepspeed(CONFIGS[name])
    differences = []
    for accessor in SCALARS:
        expected = _plain(getattr(theirs, accessor)())
        got = _plain(getattr(ours, accessor)())
        if got != expected:
            differences.append(f"{accessor}: zeroshard {got!r}, DeepSpeed {expected!r}")
    for accessor in RAISING_IN_DEEPSPEED:
        try:
            expected = getattr(theirs, accessor)()
        except TypeError:
            expected = False
        if getattr(ours, accessor)() != expected:
            differences.append(f"{accessor}: zeroshard {getattr(ours, accessor)()!r}, DeepSpeed {expected!r}")
    for accessor in ENABLED_OF:
        if getattr(ours, accessor)()["enabled"] != getattr(theirs, accessor)()["enabled"]:
            differences.append(f"{accessor}: enabled differs")
    for accessor in TRUTH_VALUES:
        if getattr(ours, accessor)() is not bool(getattr(theirs, accessor)()):
            differences.append(f"{accessor}: zeroshard {getattr(ours, accessor)()!r}")
    for accessor, fields in BLOCKS.items():
        expected, got = getattr(theirs, accessor)(), getattr(ours, accessor)()
        if (expected is None) != (got is None):
            differences.append(f"{accessor}: zeroshard {got!r}, DeepSpeed {expected!r}")
        elif expected is not None:
            for field in fields:
                if _plain(getattr(got, field)) != _plain(getattr(expected, field)):
                    differences.append(f"{accessor}.{field}: {getattr(got, field)!r} vs {getattr(expected, field)!r}")
    if _plain(ours.communication_data_type) != _plain(theirs.communication_data_type):
        differences.append(
            f"communication_data_type: {ours.communication_data_type} vs {theirs.communication_data_type}"
        )
    assert not differences, "\n".join(differences)


def test_every_accessor_of_deepspeeds_engine_is_answered_or_listed():
    """DeepSpeed's engine methods zeroshard's engine lacks are the ones the Note names as left out."""
    engine_cls = import_deepspeed("deepspeed.runtime.engine").DeepSpeedEngine
    from zeroshard.engine import Engine

    theirs = {n for n in dir(engine_cls) if not n.startswith("_")} - set(dir(torch.nn.Module))
    missing = sorted(n for n in theirs if not hasattr(Engine, n))
    assert missing == sorted(LEFT_OUT), missing


LEFT_OUT = [
    # DeepSpeed's internal reduction helpers
    "all_gather_scalar",
    "allreduce_and_copy",
    "allreduce_bucket",
    "allreduce_gradients",
    "allreduce_no_retain",
    "buffered_allreduce_fallback",
    "sparse_all_gather",
    "sparse_allreduce",
    "sparse_allreduce_bucket",
    "sparse_allreduce_no_retain",
    "clip_fp32_gradients",
    "print_forward_breakdown",
    "get_optimizer_configuration",
    "load_moe_state_dict",
    # DeepCompile, random-LTD and data efficiency's sampler: features zeroshard does not have
    "get_autosp_backend",
    "get_autotp_backend",
    "get_deepcompile_backend",
    "get_deepspeed_compile_backend",
    "register_compile_pass",
    "random_ltd_initialize",
    "set_custom_curriculum_learning_schedule",
    "set_data_post_process_func",
    # raises AttributeError in DeepSpeed 0.19.8 itself
    "swap_tensor_config",
]
