"""Monitoring blocks: `tensorboard`, `csv_monitor`, `wandb`, `comet`, `comms_logger`, `flops_profiler`."""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.config.fields import (
    AutoPolicy,
    Bool,
    ConfigBlock,
    Float,
    Int,
    ListOf,
    Nullable,
    Path,
    Str,
    option,
)

COMET_START_MODES = ("get_or_create", "create", "get")  # what comet_ml.start accepts (DeepSpeed passes `mode` on)


@dataclass(frozen=True)
class TensorBoardConfig(ConfigBlock):
    """`tensorboard`: write training metrics as TensorBoard events."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    enabled: bool = option(False, "Log to TensorBoard (needs the tensorboard package).", Bool())
    output_path: str = option("", "Directory for the logs; empty means under the launch directory.", Path())
    job_name: str = option("DeepSpeedJobName", "Sub-directory of output_path for this job.", Str())


@dataclass(frozen=True)
class CSVMonitorConfig(ConfigBlock):
    """`csv_monitor`: write training metrics to local CSV files."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    enabled: bool = option(False, "Log to CSV files.", Bool())
    output_path: str = option("", "Directory for the files; empty means under the launch directory.", Path())
    job_name: str = option("DeepSpeedJobName", "Sub-directory of output_path for this job.", Str())


@dataclass(frozen=True)
class WandbConfig(ConfigBlock):
    """`wandb`: log training metrics to Weights & Biases."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    enabled: bool = option(False, "Log to WandB (needs the wandb package).", Bool())
    group: str | None = option(None, "WandB group of runs.", Nullable(Str()))
    team: str | None = option(None, "WandB team.", Nullable(Str()))
    project: str = option("deepspeed", "WandB project.", Str())


@dataclass(frozen=True)
class CometConfig(ConfigBlock):
    """`comet`: log training metrics to Comet."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    enabled: bool = option(False, "Log to Comet (needs the comet_ml package).", Bool())
    samples_log_interval: int = option(100, "Submit metrics every this many samples.", Int())
    project: str | None = option(None, "Comet project name.", Nullable(Str()))
    workspace: str | None = option(None, "Comet workspace.", Nullable(Str()))
    api_key: str | None = option(None, "Comet API key.", Nullable(Str()))
    experiment_name: str | None = option(None, "Comet experiment name.", Nullable(Str()))
    experiment_key: str | None = option(None, "Key of an existing Comet experiment.", Nullable(Str()))
    online: bool | None = option(None, "Log online (true) or store an offline experiment.", Nullable(Bool()))
    mode: str | None = option(
        None,
        'How the experiment starts: "get" (an existing one, by experiment_key), "create" or "get_or_create" '
        "(comet_ml.start's modes; null: comet_ml's default, get_or_create).",
        Nullable(Str(choices=COMET_START_MODES)),
    )


@dataclass(frozen=True)
class CommsLoggerConfig(ConfigBlock):
    """`comms_logger`: log the collectives the engine issues."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    enabled: bool = option(False, "Log communication operations.", Bool())
    prof_all: bool = option(True, "Profile every collective (else only prof_ops).", Bool())
    prof_ops: tuple[str, ...] = option(
        (),
        "Collectives to profile, by DeepSpeed's names; the engine issues all_reduce, reduce_scatter_tensor, "
        "all_gather_into_tensor and broadcast.",
        ListOf(Str()),
    )
    verbose: bool = option(False, "Log every operation as it happens.", Bool())
    debug: bool = option(False, "Add the calling function to each record.", Bool())


@dataclass(frozen=True)
class FlopsProfilerConfig(ConfigBlock):
    """`flops_profiler`: profile the model's FLOPs, latency and parameters at one step."""

    enabled: bool = option(False, "Run the FLOPs profiler.", Bool())
    recompute_fwd_factor: float = option(0.0, "Extra forward passes from activation recomputation.", Float())
    profile_step: int = option(1, "Global step at which to profile.", Int(minimum=0))
    module_depth: int = option(-1, "Depth of the per-module report; -1 is all.", Int())
    top_modules: int = option(1, "Modules listed in the aggregated report.", Int())
    detailed: bool = option(True, "Print the per-module profile.", Bool())
    output_file: str | None = option(None, "Write the report here instead of stdout.", Nullable(Path()))
