"""What a search leaves behind: the results table (CSV), the best ds_config, a plot (PNG), and a summary."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from zeroshard.autotuning.tuner import Search

COLUMNS = (
    "name",
    "stage",
    "offload_optimizer",
    "offload_param",
    "micro_batch",
    "bucket",
    "estimated_bytes",
    "status",
    "step_s",
    "samples_per_s",
    "peak_bytes",
    "reused",
    "error",
)


def rows(search: Search) -> list[dict[str, Any]]:
    trials = ([search.baseline] if search.baseline is not None else []) + list(search.trials)
    out = []
    for i, trial in enumerate(trials):
        row = {**trial.experiment.to_json(), **trial.result, "reused": trial.reused}
        if i == 0 and search.baseline is not None:
            row["name"] = "baseline"
        out.append({k: row.get(k, "") for k in COLUMNS})
    return out


def write(search: Search, base_config: dict[str, Any], results_dir: Path) -> dict[str, Path]:
    results_dir.mkdir(parents=True, exist_ok=True)
    written = {"csv": results_dir / "results.csv"}
    with open(written["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows(search))
    if search.best is not None:
        written["ds_config"] = results_dir / "ds_config_optimal.json"
        written["ds_config"].write_text(json.dumps(search.best.experiment.ds_config(base_config), indent=2))
    if plot(rows(search), results_dir / "results.png"):
        written["plot"] = results_dir / "results.png"
    return written


def plot(table: list[dict[str, Any]], path: Path) -> bool:
    """Samples/s per trial (failed and over-cap trials as empty bars, labelled); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [r["name"] for r in table]
    values = [float(r["samples_per_s"]) if r["status"] == "ok" else 0.0 for r in table]
    colors = {"ok": "tab:blue", "over_cap": "tab:orange", "failed": "tab:red"}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(names)), 4.2))
    ax.bar(range(len(names)), values, color=[colors.get(r["status"], "grey") for r in table])
    for i, r in enumerate(table):
        if r["status"] != "ok":
            ax.text(i, 0, r["status"], rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("samples / s")
    ax.set_title(
        "zeroshard autotune: measured throughput per trial\n(orange: over the memory cap, red: failed)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
