"""`ZeroshardConfig`: the top level of a ds_config, one attribute per DeepSpeed key.

Keys, defaults and accepted values follow DeepSpeed 0.19.8 (runtime/config.py, runtime/constants.py
and the block configs). Keys that 0.19.8 removed but older configs still carry (amp, elasticity,
curriculum_learning, sparse_attention, ...) are accepted too; `support.UNIMPLEMENTED` says which keys
zeroshard reads but does not act on yet.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from zeroshard.config.features import (
    ActivationCheckpointingConfig,
    AioConfig,
    CheckpointConfig,
    CompileConfig,
    ElasticityConfig,
    HybridEngineConfig,
    TimersConfig,
    ZeroshardExtrasConfig,
)
from zeroshard.config.fields import (
    AutoPolicy,
    Bool,
    ConfigBlock,
    DType,
    Float,
    Int,
    Moved,
    NeverIfInfinite,
    Nullable,
    Str,
    block,
    internal,
    opaque,
    option,
)
from zeroshard.config.monitor import (
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from zeroshard.config.optimizer import OptimizerConfig, SchedulerConfig
from zeroshard.config.precision import BF16Config, DataTypesConfig, FP16Config, TorchAutocastConfig
from zeroshard.config.schedules import CurriculumLearningConfig, ProgressiveLayerDropConfig
from zeroshard.config.zero import ZeroConfig

_BATCH = Nullable(Int(minimum=1))
_RESOLVE = AutoPolicy.RESOLVE


@dataclass(frozen=True)
class ZeroshardConfig(ConfigBlock):
    """A validated ds_config. Build it with `parse_config`, complete it with `resolve_config`.

    Example:
        >>> from zeroshard.config import parse_config, resolve_config
        >>> cfg = parse_config({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}})
        >>> cfg = resolve_config(cfg, world_size=2, known={"train_micro_batch_size_per_gpu": 4})
        >>> (cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.zero_optimization.overlap_comm)
        (8, 1, False)
    """

    MOVED = (
        Moved("bfloat16", ("bf16",)),
        Moved("seq_parallel_comm_data_type", ("seq_parallel_communication_data_type",)),
    )

    # Batch: train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size.
    train_batch_size: int | None = option(
        None,
        "Samples per optimizer step over all ranks (None only before resolve_config).",
        _BATCH,
        auto=_RESOLVE,
    )
    train_micro_batch_size_per_gpu: int | None = option(
        None,
        "Samples per forward/backward on one rank (None only before resolve_config).",
        _BATCH,
        auto=_RESOLVE,
    )
    gradient_accumulation_steps: int | None = option(
        None, "Micro-steps per optimizer step (None only before resolve_config).", _BATCH, auto=_RESOLVE
    )
    managed_gradient_accumulation: bool = option(
        True,
        "The engine steps the optimizer on accumulation boundaries (false: every step() updates).",
        Bool(),
    )

    # Optimization.
    optimizer: OptimizerConfig | None = block(
        OptimizerConfig, "Optimizer to build; None: the client passes one.", optional=True
    )
    scheduler: SchedulerConfig | None = block(
        SchedulerConfig, "LR scheduler to build; None: none or the client's.", optional=True
    )
    gradient_clipping: float = option(
        1.0,
        "Clip the global gradient norm to this value; 0.0 turns clipping off.",
        Float(minimum=0.0),
        auto=_RESOLVE,
    )
    zero_allow_untested_optimizer: bool = option(False, "Allow ZeRO with an optimizer it was not tested with.", Bool())
    zero_force_ds_cpu_optimizer: bool = option(
        True, "Require DeepSpeed's CPU optimizer with optimizer offload.", Bool()
    )
    zero_optimization: ZeroConfig = block(ZeroConfig, "ZeRO partitioning (stage 0-3) and offload.")

    # Precision.
    fp16: FP16Config = block(FP16Config, "fp16 mixed precision and loss scaling.")
    bf16: BF16Config = block(BF16Config, "bf16 mixed precision (legacy key: bfloat16).")
    data_types: DataTypesConfig = block(DataTypesConfig, "Dtypes of gradient accumulation, parameters, buffers.")
    torch_autocast: TorchAutocastConfig = block(TorchAutocastConfig, "Forward under torch.autocast.")
    amp: dict[str, Any] | None = opaque("NVIDIA Apex AMP settings (removed in DeepSpeed 0.19).")

    # Communication.
    communication_data_type: str | None = option(
        None, "Dtype of gradient collectives (fp32, fp16, bf16); None: the training dtype.", Nullable(DType())
    )
    seq_parallel_communication_data_type: str | None = option(
        "fp32", "Dtype of sequence-parallel gradient collectives.", Nullable(DType())
    )
    prescale_gradients: bool = option(False, "Divide gradients by the world size before all-reduce.", Bool())
    gradient_predivide_factor: float = option(
        1.0,
        "Divide gradients by this before all-reduce and by world_size/factor after.",
        Float(positive=True),
    )
    gradient_allreduce_op: str = option(
        "mean",
        "How gradients combine across ranks: mean or sum (sum not with stage 3).",
        Str(("mean", "sum"), str.lower),
    )
    disable_allgather: bool = option(False, "Use broadcasts instead of all-gather for parameters.", Bool())
    zero_allow_comm_data_type_fp32: bool = option(False, "Allow fp32 communication with ZeRO (older releases).", Bool())
    sparse_gradients: bool = option(False, "Reduce embedding gradients sparsely (removed in DeepSpeed 0.19).", Bool())
    use_data_before_expert_parallelism: bool = option(
        False, "Order data-parallel before expert-parallel ranks in the topology.", Bool()
    )
    sequence_parallel_size: int | None = option(
        None,
        "Ulysses sequence-parallel degree: consecutive ranks split each sample's sequence; the batch arithmetic "
        "divides the world by it.",
        Nullable(Int(minimum=1)),
    )
    data_parallel_size: int | None = option(
        None,
        "Data-parallel replicas beside sequence_parallel_size (their product is the world size).",
        Nullable(Int(minimum=1)),
    )

    # Logging and profiling.
    steps_per_print: int | None = option(
        None, "Print progress every this many steps; None (or inf): never.", NeverIfInfinite(Nullable(Int(minimum=1)))
    )
    wall_clock_breakdown: bool = option(False, "Time forward, backward and step.", Bool())
    memory_breakdown: bool = option(False, "Report memory use.", Bool())
    dump_state: bool = option(False, "Print the engine state after initialisation.", Bool())
    log_level: str | None = option(
        None,
        "Level of zeroshard's logger, set at initialize (debug, info, warning, error, critical).",
        Nullable(Str(("debug", "info", "warning", "error", "critical"), str.lower)),
    )
    vocabulary_size: int | None = option(
        None, "Vocabulary size (only checked for tensor-core alignment).", Nullable(Int(minimum=1))
    )
    tensorboard: TensorBoardConfig = block(TensorBoardConfig, "TensorBoard monitor.")
    csv_monitor: CSVMonitorConfig = block(CSVMonitorConfig, "CSV monitor.")
    wandb: WandbConfig = block(WandbConfig, "Weights & Biases monitor.")
    comet: CometConfig = block(CometConfig, "Comet monitor.")
    comms_logger: CommsLoggerConfig = block(CommsLoggerConfig, "Collective-communication logger.")
    flops_profiler: FlopsProfilerConfig = block(FlopsProfilerConfig, "FLOPs profiler.")
    timers: TimersConfig = block(TimersConfig, "Engine timers.")

    # Memory and checkpointing.
    activation_checkpointing: ActivationCheckpointingConfig = block(
        ActivationCheckpointingConfig, "Activation checkpointing."
    )
    aio: AioConfig = block(AioConfig, "Asynchronous I/O for NVMe offload.")
    checkpoint: CheckpointConfig = block(CheckpointConfig, "Checkpoint validation and writing.")
    zeroshard: ZeroshardExtrasConfig = block(ZeroshardExtrasConfig, "Settings DeepSpeed has no key for.")
    datastates_ckpt: Any = opaque("DataStates asynchronous checkpointing settings.", any_json=True)
    disable_python_gc: bool = option(False, "Disable Python's automatic cyclic garbage collector.", Bool())
    dataloader_drop_last: bool = option(False, "Drop the last incomplete batch of the engine's dataloader.", Bool())

    # Other engines and features, kept as given.
    elasticity: ElasticityConfig = block(ElasticityConfig, "Elastic batch sizes (removed in DeepSpeed 0.19).")
    hybrid_engine: HybridEngineConfig = block(HybridEngineConfig, "Hybrid training/inference engine.")
    compile: CompileConfig = block(CompileConfig, "DeepCompile.")
    pipeline: dict[str, Any] | None = opaque("Pipeline-parallel engine settings.")
    tensor_parallel: dict[str, Any] | None = opaque("AutoTP training settings.")
    expert_parallel: dict[str, Any] | None = opaque("AutoEP (expert parallelism) settings.")
    weight_quantization: dict[str, Any] | None = opaque("Weight quantization settings.")
    autotuning: dict[str, Any] | None = opaque("Autotuner settings.")
    data_efficiency: dict[str, Any] | None = opaque("Data sampling and routing (curriculum, random-LTD).")
    curriculum_learning: CurriculumLearningConfig = block(
        CurriculumLearningConfig, "Legacy curriculum learning (removed in DeepSpeed 0.19)."
    )
    compression_training: dict[str, Any] | None = opaque("Compression library (removed in DeepSpeed 0.19).")
    quantize_training: dict[str, Any] | None = opaque("MoQ quantized training (removed in DeepSpeed 0.19).")
    eigenvalue: dict[str, Any] | None = opaque("Eigenvalue-based MoQ (removed in DeepSpeed 0.19).")
    progressive_layer_drop: ProgressiveLayerDropConfig = block(
        ProgressiveLayerDropConfig, "Progressive layer dropping (removed in DeepSpeed 0.19)."
    )
    sparse_attention: dict[str, Any] | None = opaque("Sparse attention kernels (removed in DeepSpeed 0.19).")
    nebula: dict[str, Any] | None = opaque("Nebula checkpointing service (removed in DeepSpeed 0.19).")
    graph_harvesting: bool = option(False, "CUDA graph harvesting (removed in DeepSpeed 0.19).", Bool())

    # Bookkeeping, not ds_config keys.
    raw: Mapping[str, Any] = internal(dict, "The mapping the user gave, unchanged (a deep copy).")
    resolved: bool = internal(bool, 'True once resolve_config has filled every "auto" and the batch triple.')

    # DeepSpeed's `engine.config` is the dict the script passed, and scripts read it by key (OpenRLHF:
    # `engine.config["zero_optimization"]["offload_optimizer"]["device"]`): reading by key reads that mapping, as
    # given (the fields above are the values the engine uses: "auto" filled, DeepSpeed's defaults in). Writing into
    # its nested dicts changes nothing the engine does, as DeepSpeed's engine read its dict once; no length, so that
    # a config stays truthy.
    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def keys(self) -> Any:
        return self.raw.keys()

    def items(self) -> Any:
        return self.raw.items()

    def values(self) -> Any:
        return self.raw.values()
