"""`deepspeed.runtime.config.DeepSpeedConfig`: a ds_config read as DeepSpeed's engine reads it, for scripts that
read one without an engine (MS-AMP, monitors built by hand, DeepSpeed's own config and monitor tests).

[Note: DeepSpeedConfig]
`DeepSpeedConfig(config, mpu=None)` parses the config with zeroshard's schema (every key checked: a misspelt key is
the same one-line ConfigError `initialize` gives, where DeepSpeed's pydantic blocks raise theirs) and completes the
batch triple over DeepSpeed's world: the mpu's data-parallel size, the world divided by a sequence-parallel mpu's
or by `sequence_parallel_size`, the world, or 1 before `torch.distributed` starts. Its attributes are DeepSpeed
0.19.8's names with the values DeepSpeed's engine accessors report (engine_settings.py, [Note: DeepSpeed's
configuration accessors]): scalars equal DeepSpeed's, and a block is zeroshard's config object, whose fields carry
DeepSpeed's key names (`zero_config.stage`, `monitor_config.tensorboard.output_path`). Differences: an inconsistent
batch triple is a ConfigError (DeepSpeed: AssertionError); DeepSpeed's parsed-only blocks with no zeroshard
counterpart (`datastates_config`, `weight_quantization_config`, `tensor_parallel_config`,
`expert_parallel_config`, `autotuning_config`, `pipeline`) are the blocks as given (None when absent).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from zeroshard.config import ZeroshardConfig, parse_config
from zeroshard.config.optimizer import DEEPSPEED_OPTIMIZERS
from zeroshard.config.resolve import resolve_config
from zeroshard.engine_settings import _DTYPES, DeepSpeedSettings
from zeroshard.monitor.config import DeepSpeedMonitorConfig


class _View(DeepSpeedSettings):
    """The engine's configuration accessors over a config alone (no optimizer, no accumulation state)."""

    def __init__(self, config: ZeroshardConfig):
        self.config = config
        self.basic_optimizer = None
        self.accumulation = None


def _world_size(config: Mapping[str, Any], mpu: Any) -> tuple[int, int]:
    """(global rank, the world the batch triple divides by) as DeepSpeed's config counts them ([Note:
    DeepSpeedConfig])."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    world = dist.get_world_size()
    if mpu is not None:
        if hasattr(mpu, "get_data_parallel_world_size"):
            return dist.get_rank(), int(mpu.get_data_parallel_world_size())
        return dist.get_rank(), world // int(mpu.get_sequence_parallel_world_size())  # Ulysses' mpu
    return dist.get_rank(), world // int(config.get("sequence_parallel_size", 1) or 1)


def _dtype(value: Any) -> torch.dtype | None:
    return _DTYPES[str(value)] if value is not None else None


class DeepSpeedConfig:
    """A ds_config (path, dict or base64 JSON) read as DeepSpeed's `DeepSpeedConfig` reads it ([Note:
    DeepSpeedConfig]).

    Example:
        >>> cfg = DeepSpeedConfig({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})
        >>> cfg.gradient_accumulation_steps, cfg.zero_optimization_stage
        (4, 0)
    """

    def __init__(self, config: str | os.PathLike[str] | Mapping[str, Any], mpu: Any = None, mesh_device: Any = None):
        parsed = parse_config(config)
        self._param_dict = config if isinstance(config, Mapping) else dict(parsed.raw)
        self.global_rank, self.world_size = _world_size(parsed.raw, mpu)
        if mesh_device is not None:
            import torch.distributed as dist

            self.world_size = dist.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
        cfg = resolve_config(parsed, world_size=self.world_size)
        self._read(cfg, _View(cfg))

    def _read(self, cfg: ZeroshardConfig, view: _View) -> None:
        self.train_batch_size = cfg.train_batch_size
        self.train_micro_batch_size_per_gpu = cfg.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.managed_gradient_accumulation = cfg.managed_gradient_accumulation
        self.steps_per_print = view.steps_per_print()
        self.dump_state = view.dump_state()
        self.disable_python_gc = cfg.disable_python_gc
        self.disable_allgather = cfg.disable_allgather
        self.communication_data_type = _dtype(cfg.communication_data_type)
        self.seq_parallel_communication_data_type = _dtype(cfg.seq_parallel_communication_data_type or "fp32")
        self.prescale_gradients = cfg.prescale_gradients
        self.gradient_predivide_factor = view.gradient_predivide_factor()
        self.gradient_allreduce_op = cfg.gradient_allreduce_op
        self.zero_config = cfg.zero_optimization
        self.zero_optimization_stage = int(cfg.zero_optimization.stage)
        self.zero_enabled = self.zero_optimization_stage > 0
        self.activation_checkpointing_config = cfg.activation_checkpointing
        self.comms_config = SimpleNamespace(
            comms_logger_enabled=bool(cfg.comms_logger.enabled), comms_logger=cfg.comms_logger
        )
        self.monitor_config = DeepSpeedMonitorConfig(cfg.tensorboard, cfg.wandb, cfg.csv_monitor, cfg.comet)
        self.gradient_clipping = float(cfg.gradient_clipping)
        self.float16_config, self.bfloat16_config = cfg.fp16, cfg.bf16
        self.torch_autocast_enabled = bool(cfg.torch_autocast.enabled)
        self.torch_autocast_dtype = view.torch_autocast_dtype()
        given = cfg.torch_autocast.lower_precision_safe_modules
        self.torch_autocast_lower_precision_safe_modules = None if given is None else list(given)
        name = cfg.optimizer.type if cfg.optimizer is not None else None
        self.optimizer_name = name.lower() if name is not None and name.lower() in DEEPSPEED_OPTIMIZERS else name
        self.optimizer_params = view.optimizer_params()
        self.optimizer_legacy_fusion = view.optimizer_legacy_fusion()
        self.zero_allow_untested_optimizer = view.zero_allow_untested_optimizer()
        self.zero_force_ds_cpu_optimizer = view.zero_force_ds_cpu_optimizer()
        self.scheduler_name = view.scheduler_name()
        self.scheduler_params = view.scheduler_params()
        self.flops_profiler_config = cfg.flops_profiler
        self.wall_clock_breakdown = view.wall_clock_breakdown()
        self.memory_breakdown = view.memory_breakdown()
        self.autotuning_config = cfg.autotuning
        self.use_data_before_expert_parallel_ = bool(cfg.use_data_before_expert_parallelism)
        self.hybrid_engine = cfg.hybrid_engine
        self.pipeline = cfg.pipeline
        self.data_efficiency_enabled = view.data_efficiency_enabled()
        self.data_efficiency_config = view.data_efficiency_config()
        self.checkpoint_tag_validation_enabled = view.checkpoint_tag_validation_enabled()
        self.checkpoint_tag_validation_fail = view.checkpoint_tag_validation_fail()
        self.load_universal_checkpoint = view.load_universal_checkpoint()
        self.use_node_local_storage = view.use_node_local_storage()
        types = cfg.data_types
        self.grad_accum_dtype, self.param_dtype = types.grad_accum_dtype, types.param_dtype
        self.buffer_dtype, self.keep_in_fp32_modules = types.buffer_dtype, types.keep_in_fp32_modules
        self.checkpoint_parallel_write_pipeline = bool(cfg.checkpoint.parallel_write.pipeline_stage)
        self.aio_config = view.aio_config()
        self.dataloader_drop_last = view.dataloader_drop_last()
        self.log_level = view.log_level()
        self.datastates_config = cfg.datastates_ckpt
        self.checkpoint_config = cfg.checkpoint
        self.weight_quantization_config = cfg.weight_quantization
        self.compile_config = cfg.compile
        self.timers_config = cfg.timers
        self.tensor_parallel_config = cfg.tensor_parallel
        self.expert_parallel_config = cfg.expert_parallel

    def print(self, name: str) -> None:
        """Log every attribute, as DeepSpeed's `DeepSpeedConfig.print`."""
        from zeroshard.utils.logging import get_logger

        logger = get_logger(__name__)
        logger.info(f"{name}:")
        for key, value in sorted(vars(self).items()):
            if key != "_param_dict":
                logger.info(f"  {key} {'.' * (29 - len(key))} {value!r}")


__all__ = ["DeepSpeedConfig"]
