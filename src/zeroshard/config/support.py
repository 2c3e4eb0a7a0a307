"""Keys zeroshard accepts but does not act on yet, in one editable list.

A config that sets one of these keys to a value other than the DeepSpeed default gets one warning
per key at parse time; default values and "auto" never warn. An entry names a key or a whole block
(then every key under it counts). When a feature lands, delete its lines here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Final

from zeroshard.config.fields import AUTO, ConfigBlock, default_of, join, show, to_json

UNIMPLEMENTED: Final[frozenset[str]] = frozenset(
    [
        # ZeRO-3: the stage number is parsed; everything specific to stage 3 is not done yet.
        "zero_optimization.stage3_model_persistence_threshold",
        "zero_optimization.stage3_module_granularity_threshold",
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
        "zero_optimization.stage3_allgather_sequential",
        "zero_optimization.memory_efficient_linear",
        "zero_optimization.pipeline_loading_checkpoint",
        "zero_optimization.override_module_apply",
        "zero_optimization.log_trace_cache_warnings",
        "zero_optimization.enable_sanity_checks",
        "zero_optimization.save_muon_momentum_buffer_in_memory",
        "zero_optimization.leaf_module",
        # Offload (CPU and NVMe) and asynchronous I/O.
        "zero_optimization.round_robin_gradients",
        "zero_force_ds_cpu_optimizer",
        "aio.single_submit",  # every chunk is its own pread/pwrite already (docs/offload_nvme.md)
        # ZeRO++, MiCS, ZenFlow and legacy ZeRO variants.
        "zero_optimization.zero_hpz_partition_size",
        "zero_optimization.zero_quantized_weights",
        "zero_optimization.zero_quantized_nontrainable_weights",
        "zero_optimization.zero_quantized_gradients",
        "zero_optimization.zeropp_loco_param",
        "zero_optimization.mics_shard_size",
        "zero_optimization.mics_hierarchical_params_gather",
        "zero_optimization.zenflow",
        "zero_optimization.legacy_stage1",
        "zero_optimization.elastic_checkpoint",
        # Precision extras.
        "fp16.fp16_master_weights_and_grads",
        "bf16.bf16_master_weights_and_grads",
        "bf16.bf16_optimizer_states",
        "data_types.param_dtype",
        "data_types.buffer_dtype",
        "data_types.keep_in_fp32_modules",
        "torch_autocast",
        "amp",
        # Communication extras.
        "gradient_allreduce_op",
        "disable_allgather",
        "zero_allow_comm_data_type_fp32",
        "seq_parallel_communication_data_type",
        "sequence_parallel_size",
        "use_data_before_expert_parallelism",
        "sparse_gradients",
        "managed_gradient_accumulation",
        # Monitoring, profiling and logging.
        "tensorboard",
        "csv_monitor",
        "wandb",
        "comet",
        "comms_logger",
        "flops_profiler",
        "memory_breakdown",
        "dump_state",
        "log_level",
        "timers",
        # Memory, checkpointing and data.
        "activation_checkpointing",
        "checkpoint.load_universal",
        "checkpoint.use_node_local_storage",
        "checkpoint.parallel_write",
        "checkpoint.checkpoint_serialization",
        "checkpoint.writer",
        "datastates_ckpt",
        "disable_python_gc",
        # Other engines and features.
        "elasticity",
        "hybrid_engine",
        "compile",
        "pipeline",
        "tensor_parallel",
        "expert_parallel",
        "weight_quantization",
        "autotuning",
        "data_efficiency",
        "curriculum_learning",
        "compression_training",
        "quantize_training",
        "eigenvalue",
        "progressive_layer_drop",
        "sparse_attention",
        "nebula",
        "graph_harvesting",
    ]
)

_SHOWN_CHARS: Final = 80


def is_unimplemented(path: str) -> bool:
    """Whether the dotted key `path`, or a block containing it, is listed in UNIMPLEMENTED."""
    parts = path.split(".")
    return any(".".join(parts[:end]) in UNIMPLEMENTED for end in range(1, len(parts) + 1))


def unimplemented_settings(cfg: ConfigBlock, path: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, value) for each unimplemented key whose value differs from the DeepSpeed default."""
    for name, f in cfg.key_fields().items():
        key = join(path, name)
        value = getattr(cfg, name)
        if isinstance(value, ConfigBlock):
            yield from unimplemented_settings(value, key)
        elif value is not AUTO and is_unimplemented(key) and value != default_of(f):
            yield key, value


def warn_unimplemented(cfg: ConfigBlock, logger: logging.Logger) -> None:
    """Log one warning line per unimplemented key the config sets to a non-default value."""
    for key, value in unimplemented_settings(cfg):
        shown = show(to_json(value))
        if len(shown) > _SHOWN_CHARS:
            shown = shown[: _SHOWN_CHARS - 3] + "..."
        logger.warning(f"zeroshard: {key}={shown} is accepted but not implemented yet; it has no effect")
