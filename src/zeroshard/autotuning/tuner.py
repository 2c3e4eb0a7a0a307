"""The search: run experiments in order, reuse finished ones, stop early, pick the best that fits.

[Note: autotuning results] A trial is `ok` (measured), `over_cap` (it ran, but its measured peak is above the
memory cap: it does not fit) or `failed` (the reason is kept: out of memory, an exception, a timeout). The best
is the `ok` trial with the highest throughput (samples/s) or lowest latency (step time), per `metric`. Early
stopping counts finished trials since the last improvement. With `overwrite` false a trial whose folder holds a
result is not run again, so an interrupted search resumes where it stopped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeroshard.autotuning.settings import AutotuningSettings
from zeroshard.autotuning.space import Experiment
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

Runner = Callable[[Path, dict[str, Any]], dict[str, Any]]


@dataclass
class Trial:
    experiment: Experiment
    result: dict[str, Any]
    reused: bool = False

    @property
    def ok(self) -> bool:
        return self.result.get("status") == "ok"

    def score(self, metric: str) -> float:
        """Higher is better."""
        return float(self.result["samples_per_s"]) if metric == "throughput" else -float(self.result["step_s"])


@dataclass
class Search:
    trials: list[Trial] = field(default_factory=list)
    baseline: Trial | None = None
    best: Trial | None = None
    stopped_early: bool = False


def run_search(
    space: list[Experiment],
    baseline: Experiment,
    base_config: dict[str, Any],
    runner: Runner,
    settings: AutotuningSettings,
    cap: int | None,
) -> Search:
    exps = Path(settings.exps_dir)
    search = Search()
    search.baseline = _trial(baseline, "baseline", base_config, runner, settings, cap, exps)
    since_best = 0
    for experiment in space[: settings.tuner_num_trials]:
        trial = _trial(experiment, experiment.name, base_config, runner, settings, cap, exps)
        search.trials.append(trial)
        if trial.ok and (search.best is None or trial.score(settings.metric) > search.best.score(settings.metric)):
            search.best, since_best = trial, 0
        else:
            since_best += 1
        if since_best >= settings.tuner_early_stopping:
            search.stopped_early = True
            break
    return search


def _trial(
    experiment: Experiment,
    name: str,
    base: dict[str, Any],
    runner: Runner,
    settings: AutotuningSettings,
    cap: int | None,
    exps: Path,
) -> Trial:
    folder = exps / name
    saved = folder / "result.json"
    if not settings.overwrite and saved.exists():
        return Trial(experiment, json.loads(saved.read_text()), reused=True)
    logger.info(f"autotuning: trial {name}")
    result = runner(folder, experiment.ds_config(base))
    if result.get("status") == "ok" and cap is not None and result["peak_bytes"] > cap:
        result = {**result, "status": "over_cap", "error": f"peak {result['peak_bytes']} bytes > cap {cap}"}
    folder.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(result))
    return Trial(experiment, result)
