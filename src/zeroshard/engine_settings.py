"""DeepSpeed's engine methods that report the configuration (`engine.zero_offload_optimizer()`,
`engine.dynamic_loss_scale()`, `engine.steps_per_print()`, ...); the calls that act on it are in engine_calls.py.

[Note: DeepSpeed's configuration accessors]
DeepSpeed's engine answers about 130 questions about its configuration, one method each, and scripts branch on them
(`if engine.zero_optimization_partition_weights(): ...`, `engine.wall_clock_breakdown()`, Accelerate and the HF
Trainer read several). Each returns what DeepSpeed 0.19.8's returns for the same ds_config: the same value for a
scalar, None where DeepSpeed has no block (`zero_offload_optimizer()` without an `offload_optimizer` key), and for a
block zeroshard's own config object, whose fields carry DeepSpeed's key names. `tests/unit/test_engine_settings.py`
holds them against DeepSpeed's own methods over seven configs; the few that read DeepSpeed's built engine
(`get_mom`, the rank getters, `zero_nvme_offload_optimizer`) follow its code. Where they differ on purpose:
`get_batch_info()` gives the three values (DeepSpeed 0.19.8 returns the three bound methods), the data-efficiency
blocks come back as given (DeepSpeed fills in its defaults), `tensor_parallel_config()` is the block as given,
`compile_zero_optimization_stage()` is False without `compile.passes` (DeepSpeed raises TypeError). Left out:
DeepSpeed's internal reduction helpers (`allreduce_bucket`, `sparse_allreduce`, `buffered_allreduce_fallback`,
...), DeepCompile's backends and random-LTD's initialisation, which belong to features zeroshard does not have, and
`swap_tensor_config`, which raises AttributeError in DeepSpeed 0.19.8 itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

_DTYPES: Mapping[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_AUTOCAST_SAFE_MODULES = [
    "torch.nn.modules.linear.Linear",
    "torch.nn.modules.conv.Conv1d",
    "torch.nn.modules.conv.Conv2d",
    "torch.nn.modules.conv.Conv3d",
]


def _at(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _setting(path: str) -> Callable[[Any], Any]:
    """A DeepSpeed accessor that returns the ds_config value at the dotted `path` (zeroshard's key names)."""

    def accessor(self: Any) -> Any:
        return _at(self.config, path)

    accessor.__doc__ = f"ds_config `{path}` (DeepSpeed's accessor of the same name)."
    return accessor


def _opaque(block: str, key: str, default: Any) -> Callable[[Any], Any]:
    """A DeepSpeed accessor of a block zeroshard keeps as the given mapping (`autotuning`, `tensor_parallel`)."""

    def accessor(self: Any) -> Any:
        return (getattr(self.config, block) or {}).get(key, default)

    accessor.__doc__ = f"ds_config `{block}.{key}` (DeepSpeed's default {default!r})."
    return accessor


def _data_efficiency(*path: str) -> Callable[[Any], Any]:
    """`data_efficiency` (accepted, not implemented: support.UNIMPLEMENTED) as DeepSpeed reports it: a sub-block
    given, or `{"enabled": False}`; its `enabled` flags False unless the config sets them."""

    def block(self: Any) -> dict[str, Any]:
        value: Any = self.config.data_efficiency or {}
        for part in path:
            value = value.get(part, {}) if isinstance(value, Mapping) else {}
        return {"enabled": False, **value}

    block.__doc__ = f"ds_config `{'.'.join(('data_efficiency', *path))}`, its `enabled` False unless set."
    return block


class DeepSpeedSettings:
    """[Note: DeepSpeed's configuration accessors]; a base of `EngineAccessors`."""

    config: Any
    basic_optimizer: torch.optim.Optimizer | None
    accumulation: Any  # AccumulationState

    def _stage(self) -> int:
        return int(self.config.zero_optimization.stage)

    # -- ZeRO ----------------------------------------------------------------------------------------
    zero_allgather_bucket_size = _setting("zero_optimization.allgather_bucket_size")
    zero_allgather_partitions = _setting("zero_optimization.allgather_partitions")
    zero_allgather_sequential = _setting("zero_optimization.stage3_allgather_sequential")
    zero_allow_untested_optimizer = _setting("zero_allow_untested_optimizer")
    zero_compute_grad_norm = _setting("zero_optimization.compute_grad_norm")
    zero_contiguous_gradients = _setting("zero_optimization.contiguous_gradients")
    zero_elastic_checkpoint = _setting("zero_optimization.elastic_checkpoint")
    zero_force_ds_cpu_optimizer = _setting("zero_force_ds_cpu_optimizer")
    zero_hpz_partition_size = _setting("zero_optimization.zero_hpz_partition_size")
    zero_ignore_unused_parameters = _setting("zero_optimization.ignore_unused_parameters")
    zero_legacy_stage1 = _setting("zero_optimization.legacy_stage1")
    zero_load_from_fp32_weights = _setting("zero_optimization.load_from_fp32_weights")
    zero_log_trace_cache_warnings = _setting("zero_optimization.log_trace_cache_warnings")
    zero_max_live_parameters = _setting("zero_optimization.stage3_max_live_parameters")
    zero_max_reuse_distance = _setting("zero_optimization.stage3_max_reuse_distance")
    zero_model_persistence_threshold = _setting("zero_optimization.stage3_model_persistence_threshold")
    zero_module_granularity_threshold = _setting("zero_optimization.stage3_module_granularity_threshold")
    zero_multi_rank_bucket_allreduce = _setting("zero_optimization.use_multi_rank_bucket_allreduce")
    zero_overlap_comm = _setting("zero_optimization.overlap_comm")
    zero_param_persistence_threshold = _setting("zero_optimization.stage3_param_persistence_threshold")
    zero_parameter_alignment = _setting("zero_optimization.parameter_alignment")
    zero_prefetch_bucket_size = _setting("zero_optimization.stage3_prefetch_bucket_size")
    zero_quantized_gradients = _setting("zero_optimization.zero_quantized_gradients")
    zero_quantized_nontrainable_weights = _setting("zero_optimization.zero_quantized_nontrainable_weights")
    zero_quantized_weights = _setting("zero_optimization.zero_quantized_weights")
    zero_reduce_bucket_size = _setting("zero_optimization.reduce_bucket_size")
    zero_reduce_scatter = _setting("zero_optimization.reduce_scatter")
    zero_round_robin_gradients = _setting("zero_optimization.round_robin_gradients")
    zero_save_muon_momentum_buffer_in_memory = _setting("zero_optimization.save_muon_momentum_buffer_in_memory")
    zero_sub_group_size = _setting("zero_optimization.sub_group_size")
    is_sanity_checks_enabled = _setting("zero_optimization.enable_sanity_checks")
    super_offload = _setting("zero_optimization.offload_optimizer.super_offload")

    def _raw_zero(self) -> Mapping[str, Any]:
        """The `zero_optimization` block as given ({} for the legacy `"zero_optimization": true`)."""
        given = self.config.raw.get("zero_optimization")
        return given if isinstance(given, Mapping) else {}

    def _offload_block(self, key: str) -> Any:
        """DeepSpeed's offload block: None unless the config gives it (or its device is set another way, as the
        legacy `cpu_offload`)."""
        block = getattr(self.config.zero_optimization, key)
        return block if self._raw_zero().get(key) is not None or block.device != "none" else None

    def zero_offload_optimizer(self) -> Any:
        """The `offload_optimizer` block (its `.device`, `.pin_memory`, `.ratio`, ...), None without one."""
        return self._offload_block("offload_optimizer")

    def zero_offload_param(self) -> Any:
        """The `offload_param` block, None without one."""
        return self._offload_block("offload_param")

    def cpuadam_cores_perc(self) -> float:
        """`offload_optimizer.cpuadam_cores_perc`; 0.9 without an offload block (DeepSpeed's)."""
        block = self.zero_offload_optimizer()
        return float(block.cpuadam_cores_perc) if block is not None else 0.9

    def zero_cpu_offload(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether the optimizer steps on the host (its states offloaded to the CPU or NVMe)."""
        return self.config.zero_optimization.offload_optimizer.device in ("cpu", "nvme")

    def zero_nvme_offload_optimizer(self) -> bool:
        """Whether the optimizer states are swapped to NVMe as DeepSpeed reports it: at stage 3 (its stage 1-2
        optimizer has no `swap_optimizer` attribute, so DeepSpeed answers False there, NVMe or not)."""
        return self._stage() == 3 and self.config.zero_optimization.offload_optimizer.device == "nvme"

    def zero_partial_offload(self) -> float:
        """`offload_optimizer.ratio`: the share of the update the host steps (1.0 without an offload block)."""
        block = self.zero_offload_optimizer()
        return float(block.ratio) if block is not None else 1.0

    def zero_optimization_partition_gradients(self) -> bool:
        return self._stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self._stage() >= 3

    def is_first_weights_partition_group(self) -> bool:
        return self._stage() >= 3

    def zenflow_config(self) -> Any:
        """`zero_optimization.zenflow` as given (accepted, not implemented), None without it."""
        return self._raw_zero().get("zenflow")

    # -- precision -------------------------------------------------------------------------------------
    fp16_master_weights_and_gradients = _setting("fp16.fp16_master_weights_and_grads")
    bf16_master_weights_and_gradients = _setting("bf16.bf16_master_weights_and_grads")
    bf16_optimizer_states = _setting("bf16.bf16_optimizer_states")
    torch_autocast_enabled = _setting("torch_autocast.enabled")

    def dynamic_loss_scale(self) -> bool:
        """Whether fp16's loss scale is dynamic (`fp16.loss_scale` 0)."""
        return float(self.config.fp16.loss_scale) == 0

    def initial_dynamic_scale(self) -> float:
        return 2**self.config.fp16.initial_scale_power  # as DeepSpeed's: an int, a float for a negative power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic loss scaler's arguments under DeepSpeed's names (with a static scale too, as DeepSpeed)."""
        fp16 = self.config.fp16
        return {
            "init_scale": 2**fp16.initial_scale_power,
            "scale_window": fp16.loss_scale_window,
            "delayed_shift": fp16.hysteresis,
            "consecutive_hysteresis": fp16.consecutive_hysteresis,
            "min_scale": fp16.min_loss_scale,
        }

    def _model_dtype(self) -> torch.dtype:
        if self.config.fp16.enabled:
            return torch.float16
        return torch.bfloat16 if self.config.bf16.enabled else torch.float32

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: `communication_data_type`, else the model's 16-bit dtype."""
        given = self.config.communication_data_type
        return _DTYPES[str(given)] if given is not None else self._model_dtype()

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the model's dtype, the gradient accumulation dtype: `data_types.grad_accum_dtype` or the model's)."""
        model = self._model_dtype()
        accum = self.config.data_types.grad_accum_dtype
        return model, _DTYPES[str(accum)] if accum is not None else model

    def torch_autocast_dtype(self) -> torch.dtype | None:
        given = self.config.torch_autocast.dtype
        return _DTYPES[str(given)] if given is not None else None

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        given = self.config.torch_autocast.lower_precision_safe_modules
        return list(_AUTOCAST_SAFE_MODULES) if given is None else list(given)

    # -- the rest of the config --------------------------------------------------------------------------
    gradient_predivide_factor = _setting("gradient_predivide_factor")
    steps_per_print = _setting("steps_per_print")

    def wall_clock_breakdown(self) -> bool:
        """`wall_clock_breakdown`, or the flops profiler on: DeepSpeed's config turns the breakdown on with it."""
        return bool(self.config.wall_clock_breakdown) or bool(self.config.flops_profiler.enabled)

    memory_breakdown = _setting("memory_breakdown")
    dump_state = _setting("dump_state")
    log_level = _setting("log_level")
    dataloader_drop_last = _setting("dataloader_drop_last")
    load_universal_checkpoint = _setting("checkpoint.load_universal")
    use_node_local_storage = _setting("checkpoint.use_node_local_storage")
    checkpoint_serialization_enabled = _setting("checkpoint.checkpoint_serialization")
    flops_profiler_module_depth = _setting("flops_profiler.module_depth")
    flops_profiler_top_modules = _setting("flops_profiler.top_modules")
    flops_profiler_output_file = _setting("flops_profiler.output_file")
    flops_profiler_recompute_fwd_factor = _setting("flops_profiler.recompute_fwd_factor")
    autotuning_enabled = _opaque("autotuning", "enabled", False)
    autotuning_metric = _opaque("autotuning", "metric", "throughput")
    autotuning_start_profile_step = _opaque("autotuning", "start_profile_step", 3)
    autotuning_end_profile_step = _opaque("autotuning", "end_profile_step", 5)
    autotp_size = _opaque("tensor_parallel", "autotp_size", 0)
    data_efficiency_config = _data_efficiency()
    data_sampling_config = _data_efficiency("data_sampling")
    curriculum_learning_config = _data_efficiency("data_sampling", "curriculum_learning")
    random_ltd_config = _data_efficiency("data_routing", "random_ltd")

    def data_efficiency_enabled(self) -> bool:
        return bool(self.data_efficiency_config()["enabled"])

    def data_sampling_enabled(self) -> bool:
        return bool(self.data_sampling_config()["enabled"])

    def curriculum_learning_enabled(self) -> bool:
        return bool(self.curriculum_learning_config()["enabled"])

    def random_ltd_enabled(self) -> bool:
        return bool(self.random_ltd_config()["enabled"])

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def optimizer_legacy_fusion(self) -> bool:
        return bool((self.config.raw.get("optimizer") or {}).get("legacy_fusion", False))

    def optimizer_params(self) -> dict[str, Any] | None:
        """The `optimizer.params` mapping ("auto" resolved); None without one, as DeepSpeed."""
        given = self.config.raw.get("optimizer")
        has = isinstance(given, Mapping) and given.get("params") is not None and self.config.optimizer is not None
        return dict(self.config.optimizer.params) if has else None

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict[str, Any] | None:
        given = self.config.raw.get("scheduler")
        has = isinstance(given, Mapping) and given.get("params") is not None and self.config.scheduler is not None
        return dict(self.config.scheduler.params) if has else None

    def checkpoint_tag_validation_enabled(self) -> bool:
        return str(self.config.checkpoint.tag_validation).upper() != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        return str(self.config.checkpoint.tag_validation).upper() == "FAIL"

    def checkpoint_writer_enabled(self) -> bool:
        return self.config.checkpoint.writer is not None

    def aio_config(self) -> dict[str, Any]:
        return self.config.aio.to_dict()

    def tensor_parallel_config(self) -> dict[str, Any]:
        """The `tensor_parallel` block as given (DeepSpeed returns its parsed model of it)."""
        return dict(self.config.tensor_parallel or {})

    def flops_profiler_enabled(self) -> bool:
        return bool(self.config.flops_profiler.enabled) or bool(self.autotuning_enabled())

    def flops_profiler_detailed(self) -> bool:
        return False if self.autotuning_enabled() else bool(self.config.flops_profiler.detailed)

    def flops_profiler_profile_step(self) -> int:
        if self.autotuning_enabled():
            return int(self.autotuning_start_profile_step())
        return int(self.config.flops_profiler.profile_step)

    def autotuning_metric_path(self) -> str:
        import os

        return (self.config.autotuning or {}).get("metric_path") or os.path.join(os.getcwd(), "autotuning_metric.json")

    def autotuning_model_info_path(self) -> str:
        import os

        given = (self.config.autotuning or {}).get("model_info_path")
        return given or os.path.join(os.getcwd(), "autotuning_model_info.json")

    def autotuning_profile_model_info(self) -> bool:
        info = (self.config.autotuning or {}).get("model_info")
        return bool(self.autotuning_enabled() and info and info.get("profile", False))

    # -- DeepCompile (the `compile` block is accepted, not implemented) ----------------------------------
    def _compile_passes(self) -> list[str]:
        return list((self.config.raw.get("compile") or {}).get("passes") or [])

    def is_deepcompile_enabled(self) -> bool:
        return bool(self.config.compile.deepcompile)

    def is_deepcompile_active(self) -> bool:
        return False

    def compile_autosp(self) -> bool:
        return "autosp" in self._compile_passes()

    def compile_autotp(self) -> bool:
        return "autotp" in self._compile_passes()

    def compile_zero_optimization_stage(self) -> bool:
        return bool({"z1", "z3"} & set(self._compile_passes()))

    def uses_parallelization_pass_only(self) -> bool:
        return self.compile_autosp() or self.compile_autotp()

    def get_compile_time(self) -> list[Any]:
        """DeepCompile's per-pass times; empty, since zeroshard runs none of its passes."""
        return []

    # -- batch sizes --------------------------------------------------------------------------------------
    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps). DeepSpeed 0.19.8 returns
        the three bound methods rather than their values, which its docstring does not describe; these are
        the values its docstring promises."""
        config = self.config
        gas = int(self.accumulation.gradient_accumulation_steps)
        return int(config.train_batch_size), int(config.train_micro_batch_size_per_gpu), gas

    # -- ranks (DeepSpeed's answers come from its groups module, as these do) ---------------------------
    def get_data_parallel_rank(self) -> int:
        from zeroshard.utils import groups

        return groups.get_data_parallel_rank()

    def get_model_parallel_rank(self) -> int:
        from zeroshard.utils import groups

        return groups.get_model_parallel_rank()

    def get_tensor_parallel_rank(self) -> int:
        from zeroshard.utils import groups

        return groups.get_model_parallel_rank()

    # -- optimizer groups ----------------------------------------------------------------------------------
    def _optimizer_param(self, name: str) -> list[Any]:
        """Each param group's `name` (0.0 where a group has none), as DeepSpeed's `_get_optimizer_param`."""
        if self.basic_optimizer is None:
            return []
        return [group.get(name, 0.0) for group in self.basic_optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Each group's momentum (SGD, RMSprop) or betas (the others)."""
        name = type(self.basic_optimizer).__name__ if self.basic_optimizer is not None else ""
        return self._optimizer_param("momentum" if name in ("SGD", "RMSprop") else "betas")

    def get_type(self) -> list[Any]:
        return self._optimizer_param("type")
