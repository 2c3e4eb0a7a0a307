"""Feature blocks: `activation_checkpointing`, `aio`, `checkpoint`, `elasticity`, `hybrid_engine`,
`compile` and `timers`."""

from __future__ import annotations

import os
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
    Str,
    block,
    option,
)
from zeroshard.errors import ConfigError

_SIZE = Int(minimum=0)


@dataclass(frozen=True)
class ActivationCheckpointingConfig(ConfigBlock):
    """`activation_checkpointing`: recompute activations in backward instead of storing them."""

    partition_activations: bool = option(
        False, "Partition checkpointed activations across model-parallel ranks.", Bool()
    )
    number_checkpoints: int | None = option(None, "Number of checkpoints kept in contiguous memory.", Nullable(Int()))
    contiguous_memory_optimization: bool = option(False, "Copy checkpoints into one contiguous buffer.", Bool())
    synchronize_checkpoint_boundary: bool = option(False, "Synchronise the device at each checkpoint.", Bool())
    profile: bool = option(False, "Time the forward and recomputation of each checkpoint.", Bool())
    cpu_checkpointing: bool = option(False, "Keep checkpointed activations in CPU memory.", Bool())


@dataclass(frozen=True)
class AioConfig(ConfigBlock):
    """`aio`: asynchronous I/O settings for NVMe offload."""

    MOVED = (Moved("thread_count", ("intra_op_parallelism",)),)

    block_size: int = option(1_048_576, "Bytes per I/O request.", _SIZE)
    queue_depth: int = option(8, "I/O requests in flight.", _SIZE)
    intra_op_parallelism: int = option(1, "Threads per I/O operation.", Int(minimum=1))
    single_submit: bool = option(False, "Submit requests one at a time (else in batches).", Bool())
    overlap_events: bool = option(True, "Overlap submission and completion of requests.", Bool())
    use_gds: bool = option(False, "Use NVIDIA GPUDirect Storage.", Bool())


@dataclass(frozen=True)
class ParallelWriteConfig(ConfigBlock):
    """`checkpoint.parallel_write`: parallel checkpoint writing."""

    pipeline_stage: bool = option(False, "Write pipeline-stage checkpoints in parallel.", Bool())


@dataclass(frozen=True)
class CheckpointWriterConfig(ConfigBlock):
    """`checkpoint.writer`: how checkpoint files are written ([Note: decoupled checkpoint writes])."""

    type: str = option(
        "FAST",
        "Writer: PYTHON or FAST (both zeroshard's writer); MOCK refused.",
        Str(("MOCK", "PYTHON", "FAST"), str.upper),
    )
    decoupled: bool = option(
        False, "Write on a thread while training goes on; commit at the next optimizer step.", Bool()
    )
    io_buffer_size: int = option(64 * 1024**2, "Bytes in the I/O buffer.", _SIZE)
    io_buffer_double: bool = option(True, "Double-buffer the I/O.", Bool())
    show_statistics: bool = option(False, "Log each rank's bytes, seconds and MiB/s per save.", Bool())
    data_parallel: str | None = option(
        None,
        "Writer parallelism unit: REPLICA, SOCKET or MACHINE.",
        Nullable(Str(("REPLICA", "SOCKET", "MACHINE"), str.upper)),
    )
    io_multiplier: int = option(1, "I/O parallelism multiplier.", Int(minimum=1))


@dataclass(frozen=True)
class CheckpointConfig(ConfigBlock):
    """`checkpoint`: checkpoint validation and writing."""

    tag_validation: str = option(
        "WARN",
        "Check that all ranks save the same tag: Warn, Ignore or Fail.",
        Str(("WARN", "IGNORE", "FAIL"), str.upper),
    )
    load_universal: bool = option(False, "Load a universal (resharding) checkpoint.", Bool())
    use_node_local_storage: bool = option(False, "Each node writes to its own local storage.", Bool())
    parallel_write: ParallelWriteConfig = block(ParallelWriteConfig, "Parallel checkpoint writing.")
    checkpoint_serialization: bool = option(True, "Serialise with torch.save (else the raw writer).", Bool())
    writer: CheckpointWriterConfig | None = block(CheckpointWriterConfig, "The fast checkpoint writer.", optional=True)


@dataclass(frozen=True)
class ElasticityConfig(ConfigBlock):
    """`elasticity`: choose a batch size that works for a range of GPU counts (removed in DeepSpeed 0.19)."""

    enabled: bool = option(False, "Enable elastic batch-size selection.", Bool())
    max_train_batch_size: int = option(2000, "Largest acceptable train_batch_size.", Int(minimum=1))
    micro_batch_sizes: tuple[int, ...] = option((2, 4, 6), "Candidate micro-batch sizes.", ListOf(Int(minimum=1)))
    min_gpus: int = option(1, "Fewest GPUs to support.", Int(minimum=1))
    max_gpus: int = option(10000, "Most GPUs to support.", Int(minimum=1))
    num_gpus_per_node: int = option(1, "GPUs per node.", Int(minimum=1))
    model_parallel_size: int = option(1, "Model-parallel degree.", Int(minimum=1))
    min_time: int = option(0, "Minimum running time (minutes) before scaling.", Int(minimum=0))
    prefer_larger_batch: bool = option(True, "Prefer the larger of equally good batch sizes.", Bool())
    ignore_non_elastic_batch_info: bool = option(False, "Ignore the non-elastic batch keys.", Bool())
    version: float = option(0.2, "Elasticity algorithm version.", Float())


@dataclass(frozen=True)
class HybridEngineConfig(ConfigBlock):
    """`hybrid_engine`: switch one model between training and inference kernels (RLHF)."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    enabled: bool = option(False, "Enable the hybrid engine.", Bool())
    max_out_tokens: int = option(512, "Most tokens generated per call.", Int(minimum=1))
    inference_tp_size: int = option(1, "Tensor-parallel degree for generation.", Int(minimum=1))
    release_inference_cache: bool = option(False, "Free the inference cache after generation.", Bool())
    pin_parameters: bool = option(True, "Pin parameters in memory during generation.", Bool())
    tp_gather_partition_size: int = option(8, "Partition size of the tensor-parallel gather.", Int(minimum=1))
    enable_cuda_graph: bool = option(False, "Capture generation in CUDA graphs.", Bool())


@dataclass(frozen=True)
class CompileConfig(ConfigBlock):
    """`compile`: DeepCompile settings for engine.compile()."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    deepcompile: bool = option(False, "Turn on DeepCompile.", Bool())
    autoep_non_moe: bool = option(False, "Compile parents of AutoEP layers, keeping AutoEP eager.", Bool())
    free_activation: bool = option(False, "Free activations eagerly.", Bool())
    free_activation_threshold: int = option(10 * 1024 * 1024, "Bytes above which activations are freed.", _SIZE)
    offload_activation: bool = option(False, "Offload saved activations to pinned host memory.", Bool())
    offload_activation_pin_memory: bool = option(True, "Pin the host buffers of activation offload.", Bool())
    offload_opt_states: bool = option(False, "Offload optimizer states between steps.", Bool())
    double_buffer: bool = option(True, "Double buffering.", Bool())
    symmetric_memory: bool = option(False, "Symmetric memory.", Bool())
    debug_log: bool = option(False, "Dump compiled graphs.", Bool())
    offload_parameters: bool = option(False, "Parameter offloading.", Bool())
    sync_before_reduce: bool = option(False, "Synchronise before reduce.", Bool())
    sync_after_reduce: bool = option(False, "Synchronise after reduce.", Bool())
    sync_before_allgather: bool = option(False, "Synchronise before all-gather.", Bool())
    sync_after_allgather: bool = option(False, "Synchronise after all-gather.", Bool())
    keep_int_input_tensors: bool = option(True, "Keep real int input tensors in the input storage.", Bool())
    keep_all_input_tensors: bool = option(False, "Keep all real input tensors in the input storage.", Bool())
    passes: tuple[str, ...] | None = option(
        None,
        "Optimisation passes: z1, z3, autosp, autotp.",
        Nullable(ListOf(Str(("z1", "z3", "autosp", "autotp")))),
    )


@dataclass(frozen=True)
class ThroughputTimerConfig(ConfigBlock):
    """`timers.throughput`: the samples-per-second timer."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    enabled: bool = option(True, "Measure throughput.", Bool())
    synchronized: bool = option(True, "Synchronise the device when timing (accurate but slower).", Bool())


@dataclass(frozen=True)
class TimersConfig(ConfigBlock):
    """`timers`: engine timers."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    throughput: ThroughputTimerConfig = block(ThroughputTimerConfig, "The throughput timer.")


@dataclass(frozen=True)
class ZeroshardExtrasConfig(ConfigBlock):
    """`zeroshard`: settings of ours that DeepSpeed has no key for (DeepSpeed ignores the block)."""

    collective_timeout_s: float = option(
        300.0,
        "Seconds a collective may wait for every rank before the job fails, naming the ranks that did not arrive "
        "(the process group's timeout; DeepSpeed's DEEPSPEED_TIMEOUT, in minutes, is read when this is unset).",
        Float(minimum=1.0),
    )
    backend: str = option(
        "zero",
        'The engine under the same API and config: "zero" (zeroshard\'s own ZeRO stages) or "fsdp2" (PyTorch '
        "FSDP2's fully_shard; stages 2 and 3 only, see docs/fsdp2.md). initialize(backend=...) overrides it.",
        Str(choices=("zero", "fsdp2")),
    )
    stage3_root_by_module: bool = option(
        True,
        "Stage 3 gathers the root unit (embeddings, final norm, head) in the modules that own its parameters "
        "([Note: root unit by module]); false gathers it for the root's whole forward and backward, for a model "
        "that reads a root parameter outside those modules only on paths its first forward does not take.",
        Bool(),
    )


def collective_timeout(raw: Any = None) -> float:
    """The deadline in seconds of a process group zeroshard starts: `zeroshard.collective_timeout_s` where the ds_config
    `raw` (the user's mapping; None: no config yet) sets it, else DeepSpeed's DEEPSPEED_TIMEOUT (minutes) where that
    is set, else the key's default. `initialize`, `zero.Init` and a `GatheredParameters` block before `initialize`
    start the group with it, whichever comes first."""
    block = raw.get("zeroshard") if isinstance(raw, Mapping) else None
    if isinstance(block, Mapping) and "collective_timeout_s" in block:
        return float(Float(minimum=1.0)(block["collective_timeout_s"], "zeroshard.collective_timeout_s"))
    legacy = os.environ.get("DEEPSPEED_TIMEOUT")
    if legacy:
        try:
            minutes = float(legacy)
        except ValueError:
            raise ConfigError(f"DEEPSPEED_TIMEOUT={legacy!r}: expected minutes, a number") from None
        return 60.0 * minutes
    return float(ZeroshardExtrasConfig().collective_timeout_s)
