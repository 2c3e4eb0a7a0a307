"""From row results to comparisons: ratios against DDP and DeepSpeed, loss agreement, ZeRO formulas, targets.

Pure functions over the rows' JSON dicts, so the report and the test share them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

LOSS_RTOL = 1e-5  # fp32: final losses of all rows agree to this relative tolerance

Row = dict[str, Any]


def ok(row: Row) -> bool:
    return row.get("status") == "ok"


def merge_repeats(runs: list[Row]) -> Row:
    """One row from several runs of it (`--repeats`): step times pooled, memory the worst seen."""
    good = [r for r in runs if ok(r)]
    if not good:
        return runs[-1]
    if len(good) == 1:
        return good[0]
    merged = dict(good[0])
    times = [t for r in good for t in r["step_times"]]
    q = statistics.quantiles(times, n=4)
    median = statistics.median(times)
    merged.update(
        step_times=times,
        step_time_median=median,
        step_time_p25=q[0],
        step_time_p75=q[2],
        step_time_min=min(times),
        step_time_max=max(times),
        tokens_per_s=merged["tokens_per_step"] / median,
        peak_rss=[max(vals) for vals in zip(*(r["peak_rss"] for r in good), strict=True)],
        repeats=len(good),
    )
    return merged


def zero_formula_bytes(row: Row) -> float:
    """Model-state bytes per rank the ZeRO paper's formulas give for fp32 training with Adam.

    Ψ trainable parameters, N ranks: fp32 weights (4Ψ), fp32 gradients (4Ψ), Adam m and v (8Ψ); ZeRO stages 1-3
    also keep the fp32 master copy of the partition (4Ψ/N), as DeepSpeed does. FSDP2 keeps no copy. A frozen
    parameter (LoRA rows) is its fp32 weight only: 4 bytes, sharded at stage 3 and by FSDP2.
    """
    psi, n, stage = row.get("trainable", row["params"]), row["world_size"], row["stage"]
    frozen = 4 * (row["params"] - psi) / (n if stage == 3 else 1)
    if row["framework"] == "fsdp2":
        return frozen + 16 * psi / n
    return frozen + {0: 16 * psi, 1: 8 * psi + 12 * psi / n, 2: 4 * psi + 16 * psi / n, 3: 20 * psi / n}[stage]


def peak_rss(row: Row) -> int:
    return max(row["peak_rss"])


def model_state_bytes(row: Row) -> int:
    return max(int(r["total"]) for r in row["model_state"])


def comm_bytes(row: Row) -> float:
    return float(row["comm_counted"].get("total", 0.0))


@dataclass(frozen=True)
class Compared:
    """A row with what it is compared against in the same run (same size and ranks)."""

    row: Row
    vs_ddp: float | None
    vs_deepspeed: float | None
    vs_fsdp2: float | None
    loss_rel: float | None
    formula_rel: float | None

    @property
    def loss_ok(self) -> bool:
        return self.loss_rel is None or self.loss_rel <= LOSS_RTOL


def _key(row: Row) -> tuple[str, int]:
    return row["size"], row["world_size"]


def _find(rows: Iterable[Row], framework: str, stage: int | None = None, offload: bool = False) -> Row | None:
    for r in rows:
        if (
            ok(r)
            and r["framework"] == framework
            and (stage is None or r["stage"] == stage)
            and bool(r.get("offload")) == offload
        ):
            return r
    return None


def _ratio(a: Row, b: Row | None) -> float | None:
    if b is None or a is b:
        return None
    return float(a["step_time_median"]) / float(b["step_time_median"])


def compare(rows: list[Row]) -> list[Compared | Row]:
    """Each ok row with its ratios; rows that did not run are passed through unchanged."""
    out: list[Compared | Row] = []
    for row in rows:
        if not ok(row):
            out.append(row)
            continue
        same = [r for r in rows if _key(r) == _key(row)]
        ddp = _find(same, "ddp")
        ds = (
            _find(same, "deepspeed", row["stage"], bool(row.get("offload")))
            if row["framework"] != "deepspeed"
            else None
        )
        fsdp2 = _find(same, "fsdp2") if row["framework"] == "zeroshard" and row["stage"] == 3 else None
        reference = ddp or next((r for r in same if ok(r)), None)
        loss_rel = None
        if reference is not None and reference is not row:
            base = float(reference["final_loss"])
            loss_rel = abs(float(row["final_loss"]) - base) / max(abs(base), 1e-30)
        formula = zero_formula_bytes(row) if str(row.get("optimizer", "AdamW")).lower() in ("adam", "adamw") else None
        out.append(
            Compared(
                row,
                _ratio(row, ddp),
                _ratio(row, ds),
                _ratio(row, fsdp2),
                loss_rel,
                None if formula is None else model_state_bytes(row) / formula - 1.0,  # the formula is Adam's
            )
        )
    return out


@dataclass(frozen=True)
class Target:
    """One line of the issue's targets with the measured value and whether it is met."""

    text: str
    where: str
    measured: str
    met: bool | None  # None: could not be measured in this run


_STEP_TARGETS = {1: 1.03, 2: 1.03, 3: 1.10}


def targets(compared: list[Compared | Row]) -> list[Target]:
    out: list[Target] = []
    items = [c for c in compared if isinstance(c, Compared)]
    ours = [c for c in items if c.row["framework"] == "zeroshard"]
    for c in ours:
        row = c.row
        where = f"{row['label']}, {row['size']}, N={row['world_size']}"
        limit = _STEP_TARGETS.get(row["stage"])
        if limit is not None and not row.get("offload"):
            out.append(_bound(f"step time <= {limit:.2f} x DDP", where, c.vs_ddp, limit))
        if row["stage"] > 0:  # DeepSpeed's stage 0 is its DDP; the stage-0 row is held against DDP itself
            out.append(_bound("step time <= 0.8 x DeepSpeed same stage", where, c.vs_deepspeed, 0.8))
        if row["stage"] == 3:
            out.append(_bound("step time <= FSDP2", where, c.vs_fsdp2, 1.0))
        ds = next(
            (
                d.row
                for d in items
                if d.row["framework"] == "deepspeed"
                and _key(d.row) == _key(row)
                and d.row["stage"] == row["stage"]
                and bool(d.row.get("offload")) == bool(row.get("offload"))
            ),
            None,
        )
        if row["stage"] > 0:
            rss = peak_rss(row) / peak_rss(ds) if ds is not None else None
            out.append(_bound("peak RSS per rank <= DeepSpeed same stage", where, rss, 1.0))
        out.append(_formula_target(where, c.formula_rel))
    worst = max((c.loss_rel for c in items if c.loss_rel is not None), default=None)
    out.append(
        Target(
            f"final losses of all rows agree (fp32: {LOSS_RTOL:g} relative)",
            "all rows",
            f"max {worst:.1e}" if worst is not None else "n/a",
            None if worst is None else worst <= LOSS_RTOL,
        )
    )
    return out


def _bound(text: str, where: str, value: float | None, limit: float) -> Target:
    if value is None:
        return Target(text, where, "n/a", None)
    return Target(text, where, f"{value:.2f} x", value <= limit)


def _formula_target(where: str, rel: float | None) -> Target:
    """Within 2% of the formula; fewer bytes than the formula (e.g. no separate fp32 master copy) also meets it."""
    text = "model-state bytes per rank within 2% of the ZeRO formula"
    if rel is None:
        return Target(text, where, "n/a", None)
    shown = f"{rel:+.1%}" + (" (below the formula)" if rel < -0.02 else "")
    return Target(text, where, shown, rel <= 0.02)
