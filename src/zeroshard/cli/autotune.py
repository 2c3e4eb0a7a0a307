"""`zeroshard autotune --model DIR --nproc-per-node N [--max-memory-per-rank BYTES] [--config ds_config.json]`.

Prunes the space with the estimator, runs short measured trials in fresh processes, writes the best ds_config,
results.csv and results.png under `results_dir`, and prints the winner with its speed-up over the baseline
(the config as given: its stage and micro-batch, DeepSpeed's defaults where it sets none).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

from zeroshard.cli.common import EXIT_CONFIG, CLIError, human_bytes, out
from zeroshard.cli.estimate.formulas import Cluster, Precision
from zeroshard.cli.estimate.shapes import from_model_arg
from zeroshard.config.parse import parse_config
from zeroshard.precision.policy import PrecisionPolicy

EXIT_NOTHING_FITS = 3


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "autotune",
        parents=parents,
        help="measure short trials of the ZeRO configurations that may fit and pick the fastest",
        description="DeepSpeed's autotuner, measured: stage x offload x micro-batch x bucket size, pruned by the "
        "memory estimate, each trial a short training run in fresh processes.",
    )
    p.add_argument("--model", required=True, help="a Hugging Face model folder (config.json, weights optional)")
    p.add_argument("--nproc-per-node", type=int, required=True, help="ranks per trial")
    p.add_argument("--max-memory-per-rank", type=float, default=None, help="bytes a rank may use (default: no cap)")
    p.add_argument("--config", default=None, help="base ds_config (its `autotuning` block sets the search)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample in the trials")
    p.add_argument("--trial-timeout", type=float, default=300.0, help="seconds before a trial counts as failed")
    for key, kind in (
        ("metric", str),
        ("tuner-type", str),
        ("tuner-num-trials", int),
        ("tuner-early-stopping", int),
        ("start-profile-step", int),
        ("end-profile-step", int),
        ("max-train-batch-size", int),
        ("results-dir", str),
        ("exps-dir", str),
    ):
        p.add_argument(f"--{key}", type=kind, default=None, help=f"autotuning.{key.replace('-', '_')}")
    p.add_argument("--resume", action="store_true", help="keep finished trials (autotuning.overwrite = false)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from zeroshard.autotuning import build_space, from_block, run_search
    from zeroshard.autotuning.report import write
    from zeroshard.autotuning.space import BUCKETS, Experiment
    from zeroshard.autotuning.trial import TrialRunner

    _check_numbers(args)
    base = json.loads(Path(args.config).read_text()) if args.config else {}
    if base:
        parse_config(base)  # a bad base config fails here, once, not in every trial
    overrides = {
        k: getattr(args, k)
        for k in (
            "metric",
            "tuner_type",
            "tuner_num_trials",
            "tuner_early_stopping",
            "start_profile_step",
            "end_profile_step",
            "max_train_batch_size",
            "results_dir",
            "exps_dir",
        )
    }
    settings = from_block(parse_config(base).autotuning if base else None, **overrides)
    if args.resume:
        settings = type(settings)(**{**settings.__dict__, "overwrite": False})
    model = from_model_arg(args.model)
    if os.path.isdir(args.model):  # weights every trial would load: found broken once, before the first trial
        from zeroshard.integrations.hf_models import check_weight_files

        check_weight_files(args.model)
    for key in ("results_dir", "exps_dir"):  # found after the trials, or by every trial
        _check_writable(f"autotuning.{key}", getattr(settings, key))
    cap = int(args.max_memory_per_rank) if args.max_memory_per_rank else None
    precision = _precision(base)
    cluster = Cluster(gpus_per_node=args.nproc_per_node)
    space, smallest = build_space(
        model, cluster, precision, args.seq_len, cap, settings.max_train_batch_size, settings.tuner_type
    )
    if not space:
        raise CLIError(
            _nothing_fits(cap, smallest[0].option.label(), smallest[0].estimated_bytes, "estimated"), EXIT_NOTHING_FITS
        )
    zero = base.get("zero_optimization", {})
    baseline = Experiment(
        int(zero.get("stage", 0)),
        zero.get("offload_optimizer", {}).get("device", "none"),
        zero.get("offload_param", {}).get("device", "none"),
        int(base.get("train_micro_batch_size_per_gpu", 1)),
        int(zero.get("reduce_bucket_size", BUCKETS[1])),
        0,
    )
    runner = TrialRunner(
        args.model,
        args.nproc_per_node,
        args.seq_len,
        settings.start_profile_step,
        settings.end_profile_step,
        args.trial_timeout,
    )
    search = run_search(space, baseline, base, runner, settings, cap)
    written = write(search, base, Path(settings.results_dir))
    out(_summary(search, settings.metric, written, len(space)))
    if search.best is None:
        measured = [t for t in search.trials if t.result.get("peak_bytes")]
        least = min(measured, key=lambda t: t.result["peak_bytes"]) if measured else None
        label = least.experiment.name if least else smallest[0].option.label()
        need = least.result["peak_bytes"] if least else smallest[0].estimated_bytes
        raise CLIError(_nothing_fits(cap, label, need, "measured" if least else "estimated"), EXIT_NOTHING_FITS)
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    """Options no trial could run with, refused before any starts."""
    if args.nproc_per_node < 1:
        raise CLIError(f"--nproc-per-node {args.nproc_per_node} must be >= 1", EXIT_CONFIG)
    if args.seq_len < 1:
        raise CLIError(f"--seq-len {args.seq_len} must be >= 1", EXIT_CONFIG)
    if not (math.isfinite(args.trial_timeout) and args.trial_timeout > 0):
        raise CLIError(f"--trial-timeout {args.trial_timeout:g} must be a positive number of seconds", EXIT_CONFIG)
    cap = args.max_memory_per_rank
    if cap is not None and not (math.isfinite(cap) and cap >= 1):
        raise CLIError(f"--max-memory-per-rank {cap:g} must be a positive number of bytes", EXIT_CONFIG)


def _check_writable(key: str, folder: str) -> None:
    from zeroshard.utils.files import probe_writable

    try:
        probe_writable(folder, keep=False)  # a refused run leaves no empty folders behind
    except OSError as err:
        raise CLIError(
            f"{key} {folder}: cannot write there ({err.strerror}); choose another folder", EXIT_CONFIG
        ) from None


def _precision(base: dict[str, Any]) -> Precision:
    """Bytes per element as the base config trains, from the engine's own precision policy (compute, gradient
    accumulation, master and optimizer-state dtypes: [Note: bf16 master weights])."""
    policy = PrecisionPolicy.from_config(parse_config(base))
    state = policy.optimizer_state_dtype or policy.master_dtype
    return Precision(
        policy.compute_dtype.itemsize,
        policy.grad_accum_dtype.itemsize,
        2 * state.itemsize,  # Adam/AdamW: two moments
        master_bytes=policy.master_dtype.itemsize,
    )


def _nothing_fits(cap: int | None, label: str, need: int, how: str) -> str:
    if cap is None:
        return f"no trial finished (each one's reason is in results.csv); the smallest-memory option is {label}"
    return (
        f"no configuration fits under the cap of {human_bytes(cap)} per rank; the smallest-memory option, {label}, "
        f"needs {human_bytes(need)} ({how})"
    )


def _summary(search: Any, metric: str, written: dict[str, Path], space_size: int) -> str:
    lines = [f"{'trial':<44}{'status':>10}{'step':>10}{'samples/s':>11}{'peak/rank':>11}"]
    for trial in ([search.baseline] if search.baseline else []) + search.trials:
        r = trial.result
        name = "baseline" if trial is search.baseline else trial.experiment.name
        step = f"{r['step_s'] * 1e3:.0f} ms" if "step_s" in r else "-"
        rate = f"{r['samples_per_s']:.2f}" if "samples_per_s" in r else "-"
        peak = human_bytes(r["peak_bytes"]) if "peak_bytes" in r else "-"
        lines.append(
            f"{name:<44}{r['status']:>10}{step:>10}{rate:>11}{peak:>11}" + (" (reused)" if trial.reused else "")
        )
    ran = len(search.trials)
    lines.append(f"{ran} of {space_size} candidate trials" + (" (stopped early)" if search.stopped_early else ""))
    if search.best is not None:
        best = search.best
        lines.append(f"best ({metric}): {best.experiment.name}")
        if search.baseline is not None and search.baseline.ok:
            ratio = best.score(metric) / search.baseline.score(metric)
            ratio = ratio if metric == "throughput" else 1 / ratio
            lines.append(f"  {ratio:.2f}x the baseline (the config as given)")
        else:
            lines.append(f"  the baseline did not run: {search.baseline.result.get('error', '')}")
    lines += [f"  {kind}: {path}" for kind, path in written.items()]
    return "\n".join(lines)
