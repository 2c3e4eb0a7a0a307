"""The `zero_optimization` block: ZeRO stage, buckets, offload and ZeRO-3/ZeRO++ knobs.

Keys and defaults follow DeepSpeed's DeepSpeedZeroConfig (0.19.8), plus keys earlier releases
accepted (mics_*, zeropp_loco_param). Where DeepSpeed names a field differently from its JSON key
(`prefetch_bucket_size` for "stage3_prefetch_bucket_size"), our attribute is the JSON key and the
DeepSpeed attribute name is accepted as an alias.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zeroshard.config.fields import (
    AutoPolicy,
    Bool,
    ConfigBlock,
    Float,
    Int,
    ListOf,
    Moved,
    Nullable,
    Path,
    Str,
    block,
    opaque,
    option,
)

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_SIZE = Int(minimum=0)
_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def _offload_device(value: object, path: str) -> str:
    """cpu_offload / cpu_offload_param: true means device "cpu", false means "none"."""
    return "cpu" if Bool()(value, path) else "none"


def _pin(value: object, path: str) -> bool:
    return Bool()(value, path)


@dataclass(frozen=True)
class OffloadParamConfig(ConfigBlock):
    """`zero_optimization.offload_param`: where ZeRO-3 keeps partitioned parameters."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    device: str = option("none", "Where parameters live: none, cpu or nvme (stage 3 only).", Str(_OFFLOAD_DEVICES))
    nvme_path: str | None = option(None, "Filesystem path used when device is nvme.", Nullable(Path()))
    buffer_count: int = option(5, "Buffers in the NVMe parameter buffer pool.", _SIZE)
    buffer_size: int = option(100_000_000, "Elements per NVMe parameter buffer.", _SIZE)
    max_in_cpu: int = option(1_000_000_000, "Parameter elements kept in CPU memory when offloading to NVMe.", _SIZE)
    pin_memory: bool = option(True, "Offload to page-locked CPU memory (fast asynchronous copies).", Bool())


@dataclass(frozen=True)
class OffloadOptimizerConfig(ConfigBlock):
    """`zero_optimization.offload_optimizer`: where optimizer states live and the step runs."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    device: str = option("none", "Where optimizer states live: none, cpu or nvme.", Str(_OFFLOAD_DEVICES))
    nvme_path: str | None = option(None, "Filesystem path used when device is nvme.", Nullable(Path()))
    buffer_count: int = option(4, "Buffers in the NVMe optimizer-state buffer pool.", _SIZE)
    pin_memory: bool = option(True, "Offload to page-locked CPU memory (fast asynchronous copies).", Bool())
    pipeline_read: bool = option(False, "Overlap reading the next NVMe tile with the current step.", Bool())
    pipeline_write: bool = option(False, "Overlap writing the previous NVMe tile with the current step.", Bool())
    fast_init: bool = option(False, "Fast optimizer initialisation when offloading to NVMe.", Bool())
    ratio: float = option(
        1.0,
        "Fraction of optimizer states offloaded to the CPU (< 1.0: stage 3, by sub-group).",
        Float(0.0, 1.0),
    )
    super_offload: bool = option(False, "High-performance CPU offload for superchips (stage 3).", Bool())
    cpuadam_cores_perc: float = option(0.8, "Fraction of CPU cores used by CPU Adam.", Float(0.0, 1.0))

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's derived field: NVMe reads or writes overlap the step."""
        return self.pipeline_read or self.pipeline_write


def _leaf_names(value: object, path: str) -> tuple[str, ...]:
    """A list of names, or one name for a list of one, without repeats (DeepSpeed's coercion)."""
    names = ListOf(Str())([value] if isinstance(value, str) else value, path)
    return tuple(dict.fromkeys(str(name) for name in names))


@dataclass(frozen=True)
class LeafModuleConfig(ConfigBlock):
    """`zero_optimization.leaf_module`: modules ZeRO-3 fetches as a whole, without inner hooks."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    classes: tuple[str, ...] = option(_LEAF_CLASSES, "Qualified class names of leaf modules.", _leaf_names)
    names: tuple[str, ...] = option((), "Module names treated as leaves.", _leaf_names)
    name_suffixes: tuple[str, ...] = option((), "Module-name suffixes treated as leaves.", _leaf_names)


@dataclass(frozen=True)
class ZeroConfig(ConfigBlock):
    """`zero_optimization`: which training state is partitioned across data-parallel ranks."""

    AUTO_POLICY = AutoPolicy.DEFAULT
    MOVED = (
        Moved("cpu_offload", ("offload_optimizer.device",), _offload_device),
        Moved("cpu_offload_param", ("offload_param.device",), _offload_device),
        Moved("cpu_offload_use_pin_memory", ("offload_optimizer.pin_memory", "offload_param.pin_memory"), _pin),
        Moved("stage3_gather_fp16_weights_on_model_save", ("stage3_gather_16bit_weights_on_model_save",)),
    )

    stage: int = option(
        0,
        "0 off; 1 partitions optimizer states; 2 also gradients; 3 also parameters.",
        Int(choices=(0, 1, 2, 3)),
        auto=AutoPolicy.FORBID,
    )
    contiguous_gradients: bool = option(True, "Copy gradients into one contiguous buffer as produced.", Bool())
    reduce_scatter: bool = option(True, "Average gradients with reduce/reduce-scatter, not all-reduce.", Bool())
    reduce_bucket_size: int = option(
        500_000_000,
        "Elements reduced at a time. 0 is accepted (older DeepSpeed; 0.19 wants > 0).",
        _SIZE,
        auto=AutoPolicy.RESOLVE,
    )
    use_multi_rank_bucket_allreduce: bool = option(
        True, "Combine the reduce buckets of all ranks into one all-reduce.", Bool()
    )
    allgather_partitions: bool = option(True, "All-gather updated parameters (else a series of broadcasts).", Bool())
    allgather_bucket_size: int = option(500_000_000, "Elements all-gathered at a time.", _SIZE)
    overlap_comm: bool = option(
        False, "Overlap gradient reduction with backward (default: true for stage 3, else false).", Bool()
    )
    compute_grad_norm: bool = option(
        True, "Compute the global gradient norm in the stage 1/2 step (false only with stage 1 or 2).", Bool()
    )
    load_from_fp32_weights: bool = option(
        True, "Initialise fp32 master weights from the checkpoint's fp32 copy (else from 16-bit).", Bool()
    )
    elastic_checkpoint: bool = option(False, "Legacy elastic checkpoint support.", Bool())
    offload_param: OffloadParamConfig = block(OffloadParamConfig, "Parameter offload (stage 3).")
    offload_optimizer: OffloadOptimizerConfig = block(OffloadOptimizerConfig, "Optimizer state offload.")
    zenflow: dict[str, Any] | None = opaque("ZenFlow selective optimizer update settings.")
    sub_group_size: int = option(1_000_000_000, "Tile size of the optimizer step (ZeRO-3 offload/Infinity).", _SIZE)
    stage3_prefetch_bucket_size: int = option(
        50_000_000,
        "Parameter elements fetched ahead of use (ZeRO-3).",
        _SIZE,
        aliases=("prefetch_bucket_size",),
        auto=AutoPolicy.RESOLVE,
    )
    stage3_param_persistence_threshold: int = option(
        100_000,
        "Parameters with at most this many elements stay unpartitioned (ZeRO-3).",
        _SIZE,
        aliases=("param_persistence_threshold",),
        auto=AutoPolicy.RESOLVE,
    )
    stage3_model_persistence_threshold: int = option(
        sys.maxsize,
        "Upper bound on unpartitioned parameter elements (ZeRO-3).",
        _SIZE,
        aliases=("model_persistence_threshold",),
    )
    stage3_max_live_parameters: int = option(
        1_000_000_000,
        "Gathered parameter elements resident per GPU before release (ZeRO-3).",
        _SIZE,
        aliases=("max_live_parameters",),
    )
    stage3_max_reuse_distance: int = option(
        1_000_000_000,
        "Keep a parameter gathered if reused within this many elements (ZeRO-3).",
        _SIZE,
        aliases=("max_reuse_distance",),
    )
    stage3_gather_16bit_weights_on_model_save: bool = option(
        False,
        "Gather the partitioned weights when saving a 16-bit model (ZeRO-3).",
        Bool(),
        aliases=("gather_16bit_weights_on_model_save",),
    )
    stage3_module_granularity_threshold: int = option(
        0,
        "Modules finer than this are fetched as one unit (ZeRO-3).",
        Int(),
        aliases=("module_granularity_threshold",),
    )
    stage3_use_all_reduce_for_fetch_params: bool = option(
        False,
        "Fetch parameters with all-reduce instead of all-gather (ZeRO-3).",
        Bool(),
        aliases=("use_all_reduce_for_fetch_params",),
    )
    stage3_allgather_sequential: bool = option(
        False,
        "All-gather parameters one by one, without flat bucket buffers (ZeRO-3).",
        Bool(),
        aliases=("allgather_sequential",),
    )
    ignore_unused_parameters: bool = option(
        True, "Tolerate parameters that get no gradient (false: stages 1-2 raise at the step, naming them).", Bool()
    )
    legacy_stage1: bool = option(False, "The old ZeRO stage 1 implementation.", Bool())
    round_robin_gradients: bool = option(
        False, "Parallelise gradient copies to CPU across ranks (stage 1/2 with offload).", Bool()
    )
    parameter_alignment: bool = option(
        False, "Pad stage 1/2 flat buffers so each parameter starts 16-byte aligned.", Bool()
    )
    zero_hpz_partition_size: int = option(
        1, "Ranks in the secondary (hierarchical, ZeRO++ hpZ) parameter partition.", Int(minimum=0)
    )
    zero_quantized_weights: bool = option(False, "Quantize weights for the all-gather (ZeRO++ qwZ).", Bool())
    zero_quantized_nontrainable_weights: bool = option(False, "Store non-trainable weights quantized (ZeRO++).", Bool())
    zero_quantized_gradients: bool = option(False, "Quantized gradient all-to-all reduce (ZeRO++ qgZ).", Bool())
    zeropp_loco_param: dict[str, Any] | None = opaque("LoCo error feedback for quantized gradients (removed in 0.19).")
    mics_shard_size: int = option(-1, "MiCS shard group size; -1 off (removed in DeepSpeed 0.19).", Int())
    mics_hierarchical_params_gather: bool = option(
        False, "MiCS hierarchical all-gather (removed in DeepSpeed 0.19).", Bool()
    )
    memory_efficient_linear: bool = option(True, "Memory-efficient linear layer (ZeRO-3).", Bool())
    pipeline_loading_checkpoint: bool = option(False, "Load checkpoints in pipeline mode (ZeRO-3).", Bool())
    override_module_apply: bool = option(True, "Gather parameters inside nn.Module.apply (ZeRO-3).", Bool())
    log_trace_cache_warnings: bool = option(False, "Log ZeRO-3 trace-cache invalidation warnings.", Bool())
    enable_sanity_checks: bool = option(False, "Internal sanity checks, for debugging.", Bool())
    save_muon_momentum_buffer_in_memory: bool = option(
        False, "Keep the Muon momentum buffer in memory when offloading to NVMe (ZeRO-3).", Bool()
    )
    leaf_module: LeafModuleConfig = block(LeafModuleConfig, "Modules ZeRO-3 treats as leaves.")

    @classmethod
    def dynamic_defaults(cls, given: Mapping[str, object]) -> dict[str, object]:
        """overlap_comm defaults to true exactly for stage 3, as in DeepSpeed."""
        return {"overlap_comm": given.get("stage") == 3}

    # DeepSpeedZeroConfig's field names where they differ from the JSON keys (its pydantic aliases), read-only
    prefetch_bucket_size = property(lambda self: self.stage3_prefetch_bucket_size)
    param_persistence_threshold = property(lambda self: self.stage3_param_persistence_threshold)
    model_persistence_threshold = property(lambda self: self.stage3_model_persistence_threshold)
    max_live_parameters = property(lambda self: self.stage3_max_live_parameters)
    max_reuse_distance = property(lambda self: self.stage3_max_reuse_distance)
    gather_16bit_weights_on_model_save = property(lambda self: self.stage3_gather_16bit_weights_on_model_save)
    module_granularity_threshold = property(lambda self: self.stage3_module_granularity_threshold)
    use_all_reduce_for_fetch_params = property(lambda self: self.stage3_use_all_reduce_for_fetch_params)
    allgather_sequential = property(lambda self: self.stage3_allgather_sequential)
