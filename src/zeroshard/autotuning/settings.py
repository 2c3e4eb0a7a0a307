"""The `autotuning` block, with DeepSpeed's keys and defaults (deepspeed/autotuning/constants.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from zeroshard.errors import ConfigError

METRICS = ("throughput", "latency")
TUNERS = ("gridsearch", "random", "model_based")


@dataclass(frozen=True)
class AutotuningSettings:
    enabled: bool = False
    metric: str = "throughput"  # samples per second (higher is better) or step latency (lower is better)
    start_profile_step: int = 3  # steps before this one are warm-up, not timed
    end_profile_step: int = 5  # the trial stops after this step
    max_train_batch_size: int | None = None  # global batch bound: micro-batch x ranks
    mp_size: int = 1  # model parallelism: zeroshard has none, only 1 is accepted
    tuner_type: str = "gridsearch"
    tuner_num_trials: int = 50
    tuner_early_stopping: int = 5  # stop after this many finished trials without a better one
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True  # False: a rerun keeps finished trials (resume)
    fast: bool = True  # accepted for DeepSpeed configs; the search here is always the fast one

    def validate(self, tuner: bool = True) -> AutotuningSettings:
        """Types and ranges; `tuner`: also what `zeroshard autotune` cannot do (DeepSpeed's engine accepts a `flops`
        metric and an `mp_size` its autotuner reads, so a config resolved for training is not refused on them)."""
        for key in ("enabled", "overwrite", "fast"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"autotuning.{key} {getattr(self, key)!r}: true or false")
        for key in ("start_profile_step", "end_profile_step", "mp_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"autotuning.{key} {value!r}: a whole number")
        if self.metric not in (METRICS if tuner else (*METRICS, "flops")):
            raise ConfigError(f"autotuning.metric {self.metric!r}: one of {', '.join(METRICS)}")
        if self.tuner_type not in TUNERS:
            raise ConfigError(f"autotuning.tuner_type {self.tuner_type!r}: one of {', '.join(TUNERS)}")
        if tuner and self.mp_size != 1:
            raise ConfigError("autotuning.mp_size: zeroshard has no model parallelism; only 1 is accepted")
        if not 0 <= self.start_profile_step < self.end_profile_step:
            raise ConfigError("autotuning: start_profile_step must be below end_profile_step (and >= 0)")
        for key in ("tuner_num_trials", "tuner_early_stopping", "max_train_batch_size"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"autotuning.{key} {value!r}: a whole number >= 1")
        return self


# DeepSpeed's launcher plumbing (its autotuner writes them into each trial's config), ignored here
_PLUMBING = ("arg_mappings", "metric_path", "model_info", "model_info_path")
# DeepSpeed's micro-batch bounds, which `zeroshard autotune` does not read (its space: [Note: autotuning space])
DEEPSPEED_BOUNDS = (
    "min_train_batch_size",
    "max_train_micro_batch_size_per_gpu",
    "min_train_micro_batch_size_per_gpu",
    "num_tuning_micro_batch_sizes",
)


def from_block(block: Mapping[str, Any] | None, tuner: bool = True, **overrides: Any) -> AutotuningSettings:
    """The settings of a ds_config's `autotuning` block (unknown keys are an error naming the valid ones),
    then `overrides` that are not None (command-line options). `tuner`: for `zeroshard autotune`, which refuses
    DeepSpeed's micro-batch bounds (`DEEPSPEED_BOUNDS`), a `flops` metric and `mp_size` > 1 in one line; a config
    resolved for training accepts them, as DeepSpeed's engine does."""
    known = {f.name for f in fields(AutotuningSettings)}
    values = dict(block or {})
    for key in _PLUMBING:
        values.pop(key, None)
    bounds = sorted(set(values) & set(DEEPSPEED_BOUNDS))
    if bounds and tuner:
        raise ConfigError(
            f"autotuning.{bounds[0]}: DeepSpeed's autotuner reads it, zeroshard autotune does not (its micro-batches "
            "double from 1 while the estimate fits, bounded by max_train_batch_size: docs/autotuning.md); remove it"
        )
    unknown = sorted(set(values) - known - set(DEEPSPEED_BOUNDS))
    if unknown:
        raise ConfigError(f"autotuning.{unknown[0]}: unknown key; valid keys are {', '.join(sorted(known))}")
    for key in bounds:
        value = values.pop(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"autotuning.{key} {value!r}: a whole number")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return AutotuningSettings(**values).validate(tuner)


def engine_warning(block: Mapping[str, Any] | None) -> str | None:
    """The line an engine logs for `autotuning.enabled: true` in a training run (None: nothing to say). DeepSpeed's
    engine then follows its autotuner's trial protocol: it profiles steps start..end, writes
    `autotuning_metric.json` (or `model_info_path` with `model_info.profile`) and exits the process after
    `end_profile_step` + 1 steps. zeroshard's autotuner runs its own trials (`zeroshard autotune`), so the engine
    trains on, and says so."""
    if not block or block.get("enabled") is not True:
        return None
    return (
        "autotuning.enabled is true: DeepSpeed's engine would stop this process after autotuning.end_profile_step + 1 "
        "steps and write autotuning_metric.json (its autotuner's trial protocol); zeroshard's engine trains on and "
        "writes no metrics. Tune with `zeroshard autotune`, or set autotuning.enabled false"
    )
