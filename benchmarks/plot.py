"""The results plot: step time (median, IQR whiskers) and per-rank memory, one panel pair per size/ranks."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.analysis import Row, model_state_bytes, ok, peak_rss

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MiB = 2**20


def plot(rows: list[Row], path: Path) -> bool:
    """Write the PNG; False (and no file) when matplotlib is missing or no row ran."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    done = [r for r in rows if ok(r)]
    params = {r["size"]: r["params"] for r in done}
    groups = sorted({(r["size"], r["world_size"]) for r in done}, key=lambda k: (k[1], params[k[0]]))
    if not groups:
        return False
    fig, axes = plt.subplots(len(groups), 2, figsize=(13, 3.6 * len(groups)), squeeze=False)
    for (size, n), (ax_time, ax_mem) in zip(groups, axes, strict=True):
        group = [r for r in done if r["size"] == size and r["world_size"] == n]
        _time_panel(ax_time, group, f"step time, {size}, {n} ranks")
        _memory_panel(ax_mem, group, f"memory per rank, {size}, {n} ranks")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _colors(group: list[Row]) -> list[str]:
    palette = {"ddp": "tab:gray", "fsdp2": "tab:purple", "deepspeed": "tab:blue", "zeroshard": "tab:orange"}
    return [palette.get(r["framework"], "tab:green") for r in group]


def _time_panel(ax: Axes, group: list[Row], title: str) -> None:
    labels = [r["label"] for r in group]
    medians = [r["step_time_median"] for r in group]
    low = [r["step_time_median"] - r["step_time_p25"] for r in group]
    high = [r["step_time_p75"] - r["step_time_median"] for r in group]
    ax.barh(labels, medians, xerr=[low, high], color=_colors(group), capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (median, IQR)")
    ax.set_title(title)


def _memory_panel(ax: Axes, group: list[Row], title: str) -> None:
    labels = [r["label"] for r in group]
    rss = [peak_rss(r) / MiB for r in group]
    states = [model_state_bytes(r) / MiB for r in group]
    ys = list(range(len(group)))
    ax.barh([y - 0.2 for y in ys], rss, height=0.4, color=_colors(group), label="peak RSS")
    ax.barh(
        [y + 0.2 for y in ys], states, height=0.4, color=_colors(group), alpha=0.45, hatch="//", label="model states"
    )
    ax.set_yticks(ys, labels)
    ax.invert_yaxis()
    ax.set_xlabel("MiB per rank (solid: peak RSS, hatched: model states)")
    ax.set_title(title)
