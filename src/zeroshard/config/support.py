"""What zeroshard does with each ds_config key, in four editable lists.

[Note: config truth] Every key of the schema is in exactly one bucket, and
tests/unit/test_config_coverage.py walks the schema to keep it so:
- IMPLEMENTED: the code reads the key (the test finds an attribute of its name read outside config/).
- ONLY_DEFAULT: zeroshard supports only the DeepSpeed default; config/checks.py refuses any other value.
- NO_OP_BY_DESIGN: the key has nothing to change in zeroshard's implementation; the reason says why.
- UNIMPLEMENTED: accepted, not acted on yet. A config that sets one of these keys to a value other than
  the DeepSpeed default gets one warning per key at parse time; default values and "auto" never warn.
  An entry names a key or a whole block (then every key under it counts).
When a feature lands, move its lines from UNIMPLEMENTED to IMPLEMENTED.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Final

from zeroshard.config.fields import AUTO, ConfigBlock, default_of, join, show, to_json

IMPLEMENTED: Final[frozenset[str]] = frozenset(
    [
        # Batch and optimization.
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "managed_gradient_accumulation",  # [Note: caller-owned windows] in zero/strategy.py
        "zero_allow_untested_optimizer",  # [Note: client optimizers on flat shards] in optim/client.py
        "checkpoint.use_node_local_storage",  # [Note: node-local checkpoints] in checkpoint/node_local.py
        "hybrid_engine.enabled",  # [Note: hybrid engine] in hybrid_engine.py
        "hybrid_engine.pin_parameters",
        "hybrid_engine.release_inference_cache",
        "optimizer.type",
        "optimizer.params",
        "scheduler.type",
        "scheduler.params",
        "gradient_clipping",
        "pipeline",  # with a PipelineModule: pipe/context.py ([Note: pipeline config])
        "tensor_parallel",  # tp/build.py ([Note: tensor_parallel config])
        "expert_parallel",  # moe/auto.py ([Note: AutoEP])
        # elasticity: resolve_config sets the batch triple through checkpoint/elasticity.apply_elasticity.
        "elasticity.enabled",
        "elasticity.max_train_batch_size",
        "elasticity.micro_batch_sizes",
        "elasticity.min_gpus",
        "elasticity.max_gpus",
        "elasticity.num_gpus_per_node",
        "elasticity.model_parallel_size",
        "elasticity.prefer_larger_batch",
        "elasticity.ignore_non_elastic_batch_info",
        "elasticity.version",
        # ZeRO.
        "zero_optimization.stage",
        "zero_optimization.reduce_scatter",
        "zero_optimization.reduce_bucket_size",  # stages 1-2 (zero/from_config.py); stage 3: per unit (docs/compat.md)
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.overlap_comm",
        "zero_optimization.load_from_fp32_weights",
        "zero_optimization.zero_hpz_partition_size",  # ZeRO++ hpZ (zero/zeropp/)
        "zero_optimization.zero_quantized_weights",  # ZeRO++ qwZ
        "zero_optimization.zero_quantized_gradients",  # ZeRO++ qgZ
        "zero_optimization.zero_quantized_nontrainable_weights",  # zero/stage3/packed.py
        "zero_optimization.sub_group_size",
        "zero_optimization.compute_grad_norm",  # stages 1-2: zero/stepmath.py StepPolicy.compute_norm
        "zero_optimization.parameter_alignment",  # stages 1-2: FlatPolicy.param_align
        "use_data_before_expert_parallelism",  # moe/groups.py ExpertMesh.data_first
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.pipeline_loading_checkpoint",  # checkpoint/load.py `_turns`: a node's ranks in turn
        "zero_optimization.save_muon_momentum_buffer_in_memory",  # zero/from_config.py `_resident_state`
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_model_persistence_threshold",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.log_trace_cache_warnings",  # zero/stage3/schedule.py: a warning per invalidated trace
        "zero_optimization.leaf_module.classes",  # gathered whole: [Note: leaf modules] in zero/stage3/plan.py
        "zero_optimization.leaf_module.names",
        "zero_optimization.leaf_module.name_suffixes",
        # Offload.
        "zero_optimization.offload_param.device",
        "zero_optimization.offload_param.nvme_path",
        "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_param.buffer_size",
        "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.offload_param.pin_memory",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_optimizer.ratio",  # stage 3, [Note: partial offload] in offload/tier.py
        "zero_optimization.offload_optimizer.super_offload",  # stage 3, [Note: speculative host steps]
        "zero_optimization.offload_optimizer.cpuadam_cores_perc",  # its worker's cores (CUDA)
        "aio.block_size",
        "aio.queue_depth",
        "aio.intra_op_parallelism",
        "aio.overlap_events",
        # Precision and communication.
        "fp16.enabled",
        "fp16.loss_scale",
        "fp16.initial_scale_power",
        "fp16.loss_scale_window",
        "fp16.hysteresis",
        "fp16.consecutive_hysteresis",
        "fp16.min_loss_scale",
        "torch_autocast.enabled",  # engine.forward; zero/flat/autocast.py ([Note: torch autocast])
        "torch_autocast.dtype",
        "torch_autocast.lower_precision_safe_modules",
        "fp16.auto_cast",  # engine.forward casts the positional inputs (precision/cast.inputs_to_half)
        "bf16.bf16_master_weights_and_grads",  # precision/policy.py ([Note: bf16 master weights])
        "bf16.bf16_optimizer_states",
        "fp16.fp16_master_weights_and_grads",
        "bf16.enabled",
        "bf16.check_grad_overflow",
        "data_types.grad_accum_dtype",
        "data_types.param_dtype",  # must match the precision mode (config/checks.py), as DeepSpeed asserts
        "data_types.buffer_dtype",  # precision/buffers.py ([Note: buffer dtypes])
        "data_types.keep_in_fp32_modules",
        "communication_data_type",
        "prescale_gradients",
        "gradient_predivide_factor",
        "gradient_allreduce_op",  # "sum": zero/stepmath.py ([Note: pre- and post-scaling]); stages 0-2
        # Ulysses sequence parallelism (sequence/mesh.py, [Note: sequence parallelism]).
        "sequence_parallel_size",
        "data_parallel_size",
        "seq_parallel_communication_data_type",
        # Activation checkpointing (zeroshard.checkpointing; configured by initialize when the block is given).
        "activation_checkpointing.partition_activations",
        "activation_checkpointing.contiguous_memory_optimization",
        "activation_checkpointing.number_checkpoints",
        "activation_checkpointing.cpu_checkpointing",
        "activation_checkpointing.synchronize_checkpoint_boundary",
        "activation_checkpointing.profile",
        # Autotuning (zeroshard autotune reads the block; zeroshard.autotuning).
        "autotuning",
        # Logging, checkpointing and data.
        "steps_per_print",
        "checkpoint.tag_validation",
        "checkpoint.load_universal",  # checkpoint/universal.py ([Note: universal checkpoints])
        "checkpoint.writer.decoupled",  # checkpoint/decoupled.py ([Note: decoupled checkpoint writes])
        "checkpoint.writer.show_statistics",  # checkpoint/save.py, per rank and save
        "zero_optimization.ignore_unused_parameters",
        "zeroshard.collective_timeout_s",
        "zeroshard.backend",
        "zeroshard.stage3_root_by_module",
        "dataloader_drop_last",
        # Monitors, comms logger and FLOPs profiler (monitor/, comm/comms_logger.py).
        "tensorboard.enabled",
        "tensorboard.output_path",
        "tensorboard.job_name",
        "csv_monitor.enabled",
        "csv_monitor.output_path",
        "csv_monitor.job_name",
        "wandb.enabled",
        "wandb.group",
        "wandb.team",
        "wandb.project",
        "comms_logger.enabled",
        "comms_logger.prof_all",
        "comms_logger.prof_ops",
        "comms_logger.verbose",
        "comms_logger.debug",
        "flops_profiler.enabled",
        "flops_profiler.profile_step",
        "flops_profiler.module_depth",
        "flops_profiler.top_modules",
        "flops_profiler.detailed",
        "flops_profiler.output_file",
        "flops_profiler.recompute_fwd_factor",  # monitor/flops.py: the backward lines under wall_clock_breakdown
        "wall_clock_breakdown",  # monitor/wall_clock.py ([Note: wall clock breakdown])
        # monitor/throughput.py ([Note: throughput timer]); runtime/utils.see_memory_usage; utils/logging.py
        "timers.throughput.enabled",
        "timers.throughput.synchronized",
        "memory_breakdown",
        "dump_state",
        # monitor/comet.py
        "comet.enabled",
        "comet.samples_log_interval",
        "comet.project",
        "comet.workspace",
        "comet.api_key",
        "comet.experiment_name",
        "comet.experiment_key",
        "comet.online",
        "comet.mode",
        "log_level",  # utils/logging.set_log_level_from_string at initialize
        "disable_python_gc",  # runtime/python_gc.py ([Note: python gc per process])
        # runtime/schedules.py: [Note: progressive layer drop], [Note: legacy curriculum learning]
        "progressive_layer_drop.enabled",
        "progressive_layer_drop.theta",
        "progressive_layer_drop.gamma",
        "curriculum_learning.enabled",
        "curriculum_learning.curriculum_type",
        "curriculum_learning.min_difficulty",
        "curriculum_learning.max_difficulty",
        "curriculum_learning.schedule_type",
        "curriculum_learning.schedule_config.total_curriculum_step",
        "curriculum_learning.schedule_config.difficulty_step",
        "curriculum_learning.schedule_config.root_degree",
        "curriculum_learning.schedule_config.difficulty",
        "curriculum_learning.schedule_config.max_step",
    ]
)

ONLY_DEFAULT: Final[Mapping[str, str]] = MappingProxyType({})  # none today (partial offload landed)

NO_OP_BY_DESIGN: Final[Mapping[str, str]] = MappingProxyType(
    {
        "disable_allgather": "DeepSpeed 0.19.8 parses it into its config and no part of its runtime reads it",
        # DeepSpeed 0.19.8 reads it at stages 1-2 with reduce_scatter true only (reduce_scatter false all-reduces the
        # whole bucket either way); zeroshard's reduce-scatter moves what the reduces to owners move, half an all-reduce
        "zero_optimization.use_multi_rank_bucket_allreduce": (
            "true all-reduces a bucket, false reduces each slice to its owner: both give each owner its slices' sum, "
            "which zeroshard's reduce-scatter gives"
        ),
        "checkpoint.writer.type": (
            "FAST and PYTHON name DeepSpeed's two file writers; zeroshard writes with its one writer for both, and "
            "MOCK (which discards the bytes) is refused by config/checks.py"
        ),
        "checkpoint.checkpoint_serialization": (
            "DeepSpeed 0.19.8 defines an engine accessor for it that nothing calls; zeroshard's checkpoints are "
            "safetensors files and a small torch.save'd engine state"
        ),
        "zero_allow_comm_data_type_fp32": (
            "older DeepSpeed releases required it for fp32 communication with ZeRO (0.19.8 has no such key); "
            "zeroshard allows communication_data_type fp32 at every stage without it"
        ),
        "elasticity.min_time": (
            "for the scheduler (how long to run before rescaling); DeepSpeed's runtime only checks it is >= 0, as here"
        ),
        "zero_optimization.elastic_checkpoint": (
            "DeepSpeed's stage 1-2 optimizer layout for loading at another data-parallel degree, which every "
            "zeroshard checkpoint allows"
        ),
        "zero_optimization.stage3_module_granularity_threshold": (
            "fetches fine-grained modules as one to save DeepSpeed's per-module hooks; zeroshard gathers whole units "
            "(blocks, the root) and hooks only those, not each submodule"
        ),
        "zero_optimization.round_robin_gradients": (
            "spreads host gradient copies evenly over the ranks; here every rank owns 1/N of every bucket "
            "(zero/layout.py), so they are spread already"
        ),
        "optimizer.legacy_fusion": (
            "picks the legacy fused-Adam call inside DeepSpeed's stage-0 fp16 wrapper; zeroshard has one fp16 path"
        ),
        "zero_optimization.stage3_use_all_reduce_for_fetch_params": (
            "avoids DeepSpeed's per-parameter concatenation and slicing around its gathers; a unit here is "
            "all-gathered straight into its flat buffer, with nothing to concatenate or slice"
        ),
        "zero_optimization.stage3_allgather_sequential": (
            "gathers parameters one by one to skip DeepSpeed's copies into a bucket; a unit here is one flat "
            "buffer gathered in place, with no bucket copy"
        ),
        "zero_optimization.enable_sanity_checks": (
            "DeepSpeed's check that ranks reduce the same parameters; here always on: collective fingerprints on "
            "gloo, the per-step digest everywhere ([Note: divergence check])"
        ),
        "zero_optimization.memory_efficient_linear": (
            "swaps F.linear so autograd keeps no gathered weight; here a unit is released after forward and "
            "gathered again for backward whatever autograd saved"
        ),
        "zero_force_ds_cpu_optimizer": (
            "DeepSpeed refuses a client optimizer under offload_optimizer unless false; here any optimizer steps the "
            "host masters with torch's CPU kernels, so it is always allowed"
        ),
        "aio.single_submit": (
            "chooses one io_submit per request or batched ones in DeepSpeed's libaio op; zeroshard's NVMe I/O is "
            "threads over pread/pwrite, each chunk its own call (docs/offload_nvme.md)"
        ),
        "zero_optimization.contiguous_gradients": (
            "gradients always land in flat bucket buffers (zero/flat/group_buffers.py, stage-3 unit staging); "
            "there is no per-tensor gradient path to switch to"
        ),
        "zero_optimization.allgather_partitions": (
            "DeepSpeed 0.19.8 declares it but never reads it; stages 1-2 always all-gather, in both"
        ),
        "zero_optimization.offload_optimizer.pipeline_read": (
            "NVMe sub-groups are always read one ahead of the step (offload/residency.py in_turn)"
        ),
        "zero_optimization.offload_optimizer.pipeline_write": (
            "NVMe sub-groups are always written back while the next one steps (offload/residency.py in_turn)"
        ),
        "zero_optimization.offload_optimizer.fast_init": (
            "only changes how DeepSpeed first writes fp32 masters to NVMe; zeroshard writes each once as its "
            "unit is built and creates optimizer state at the first step (docs/offload_nvme.md)"
        ),
        "bf16.immediate_grad_update": (
            "when DeepSpeed's BF16_Optimizer adds a gradient into its fp32 copy (in the hook or after backward), "
            "the same additions; zeroshard always adds in the gradient hook"
        ),
        "vocabulary_size": "DeepSpeed only logs a tensor-core hint when it is not a multiple of 8 (zeroshard too)",
        "hybrid_engine.max_out_tokens": (
            "sizes DeepSpeed's inference-kernel workspace; zeroshard generates with the model's own generate"
        ),
    }
)

UNIMPLEMENTED: Final[frozenset[str]] = frozenset(
    [
        # ZeRO-3 knobs of DeepSpeed's own implementation that have no counterpart here.
        "zero_optimization.override_module_apply",
        # Offload (CPU and NVMe) and asynchronous I/O.
        "aio.use_gds",
        # ZeRO++, MiCS, ZenFlow and legacy ZeRO variants.
        "zero_optimization.zeropp_loco_param",
        "zero_optimization.mics_shard_size",
        "zero_optimization.mics_hierarchical_params_gather",
        "zero_optimization.zenflow",
        "zero_optimization.legacy_stage1",
        # Precision extras.
        "amp",
        # Communication extras.
        "sparse_gradients",
        # Monitoring, profiling and logging.
        # Memory, checkpointing and data.
        "checkpoint.parallel_write",
        # checkpoint.writer: `decoupled` and `show_statistics` are implemented; these tune DeepSpeed's aio writer
        "checkpoint.writer.io_buffer_size",
        "checkpoint.writer.io_buffer_double",
        "checkpoint.writer.io_multiplier",
        "checkpoint.writer.data_parallel",
        "datastates_ckpt",
        # Other engines and features.
        # hybrid_engine's inference-kernel settings ([Note: hybrid engine]: zeroshard generates with the model's own)
        "hybrid_engine.inference_tp_size",
        "hybrid_engine.tp_gather_partition_size",
        "hybrid_engine.enable_cuda_graph",
        "compile",
        "weight_quantization",
        "data_efficiency",
        "compression_training",
        "quantize_training",
        "eigenvalue",
        "sparse_attention",
        "nebula",
        "graph_harvesting",
    ]
)

# Unimplemented keys DeepSpeed 0.19.8 refuses (its config: "has been removed"; legacy_stage1: its initialize):
# a config from an earlier release still loads here, and the warning says the feature is gone rather than coming.
REMOVED_IN_DEEPSPEED: Final[frozenset[str]] = frozenset(
    [
        "amp",
        "sparse_gradients",
        "nebula",
        "compression_training",
        "quantize_training",
        "eigenvalue",
        "sparse_attention",
        "graph_harvesting",
        "zero_optimization.mics_shard_size",
        "zero_optimization.mics_hierarchical_params_gather",
        "zero_optimization.zeropp_loco_param",
        # DeepSpeed 0.19.8 parses it and raises at initialize: the old stage 1 left in 0.5.9
        "zero_optimization.legacy_stage1",
    ]
)

_SHOWN_CHARS: Final = 80


def is_unimplemented(path: str) -> bool:
    """Whether the dotted key `path`, or a block containing it, is listed in UNIMPLEMENTED."""
    return _listed(path, UNIMPLEMENTED)


def _listed(path: str, names: frozenset[str]) -> bool:
    """Whether the dotted key `path`, or a block containing it, is one of `names`."""
    parts = path.split(".")
    return any(".".join(parts[:end]) in names for end in range(1, len(parts) + 1))


def unimplemented_settings(cfg: ConfigBlock, path: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, value) for each unimplemented key whose value differs from the DeepSpeed default."""
    for name, f in cfg.key_fields().items():
        key = join(path, name)
        value = getattr(cfg, name)
        if isinstance(value, ConfigBlock):
            yield from unimplemented_settings(value, key)
        elif value is not AUTO and is_unimplemented(key) and value != default_of(f) and not _switched_off(value):
            yield key, value


def _switched_off(value: object) -> bool:
    """An opaque block that says `"enabled": false` and turns on nothing inside it: nothing to warn about (DeepSpeed's
    data_efficiency off; its sub-features read their own switches, so one enabled inside still warns)."""
    return isinstance(value, Mapping) and value.get("enabled") is False and not _turns_on(value)


def _turns_on(value: object) -> bool:
    if not isinstance(value, Mapping):
        return False
    return value.get("enabled") is True or any(_turns_on(inner) for inner in value.values())


def warn_unimplemented(cfg: ConfigBlock, logger: logging.Logger) -> None:
    """Log one warning line per unimplemented key the config sets to a non-default value."""
    for key, value in unimplemented_settings(cfg):
        shown = show(to_json(value))
        if len(shown) > _SHOWN_CHARS:
            shown = shown[: _SHOWN_CHARS - 3] + "..."
        if _listed(key, REMOVED_IN_DEEPSPEED):
            logger.warning(
                f"zeroshard: {key}={shown} is a feature DeepSpeed 0.19 removed (DeepSpeed refuses it); "
                "zeroshard accepts it and it has no effect"
            )
        else:
            logger.warning(f"zeroshard: {key}={shown} is accepted but not implemented yet; it has no effect")
