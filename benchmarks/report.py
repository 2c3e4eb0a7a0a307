"""The results page: docs/benchmarks.md (machine, command, table, targets, micro-benchmarks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.analysis import LOSS_RTOL, Compared, Row, comm_bytes, model_state_bytes, peak_rss, targets

MiB = 2**20


def _fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _row_line(item: Compared | Row) -> str:
    if not isinstance(item, Compared):
        r = item
        return (
            f"| {r['size']} | {r['world_size']} | {r['label']} | {r['status']}: {r.get('note', '')} "
            "| | | | | | | | | | |"
        )
    r = item.row
    spread = f"{r['step_time_p25']:.3f}–{r['step_time_p75']:.3f}"
    state_source = r["model_state"][0]["source"]
    formula = "" if item.formula_rel is None else f"{item.formula_rel:+.1%}"
    loss = f"{r['final_loss']:.6f}"
    if item.loss_rel is not None:
        mark = "" if item.loss_ok else " **DIFFERS**"
        loss += f" ({item.loss_rel:.0e}{mark})"
    engine = r.get("comm_engine")
    comm = f"{comm_bytes(r) / 1e6:.1f}"
    if engine is not None:
        comm += f" (engine {engine / 1e6:.1f})"
    load = f"{r['loadavg_1min']:.1f}" if "loadavg_1min" in r else ""
    return (
        f"| {r['size']} | {r['world_size']} | {r['label']} | {r['step_time_median']:.3f} | {spread} "
        f"| {r['tokens_per_s']:.0f} | {_fmt_ratio(item.vs_ddp)} | {_fmt_ratio(item.vs_deepspeed)} "
        f"| {peak_rss(r) / MiB:.0f} | {model_state_bytes(r) / MiB:.1f} ({state_source}) | {formula} "
        f"| {comm} | {loss} | {load} |"
    )


_HEADER = (
    "| size | N | row | step s (median) | IQR s | tokens/s | × DDP | × DeepSpeed same stage "
    "| peak RSS/rank MiB | model states/rank MiB (source) | vs ZeRO formula | comm MB/step/rank "
    "| final loss (rel. Δ vs DDP) | load |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def results_table(compared: list[Compared | Row]) -> str:
    return "\n".join([_HEADER, *(_row_line(c) for c in compared)])


def targets_table(compared: list[Compared | Row]) -> str:
    lines = ["| target | row | measured | met |", "|---|---|---|---|"]
    for t in targets(compared):
        met = "n/a" if t.met is None else ("yes" if t.met else "**no**")
        lines.append(f"| {t.text} | {t.where} | {t.measured} | {met} |")
    return "\n".join(lines)


_PROFILE_NOTE = (
    "torch.profiler over extra steps after the timed ones, rank 0: CPU time per step of zeroshard's "
    "`record_function` ranges and of the operators that carry the work, as a share of the whole step. "
    "Ranges nest (`zeroshard.backward` contains the matmuls and the gradient hooks, `AccumulateGrad` "
    "contains the launch of bucket reductions), and `gloo:*` entries are collectives running on gloo's "
    "own threads (their time overlaps the others), so the shares do not add up to 100%."
)


def profile_table(compared: list[Compared | Row]) -> str | None:
    rows = [c.row for c in compared if isinstance(c, Compared) and c.row.get("profile")]
    if not rows:
        return None
    lines = [
        _PROFILE_NOTE,
        "",
        "| row | profiled step ms | where the time goes (ms per step, share of the step) |",
        "|---|---|---|",
    ]
    for r in rows:
        prof = dict(r["profile"])
        step = prof.pop("bench.step", 0.0)
        parts = sorted(((v, k) for k, v in prof.items() if step and v >= 0.01 * step), reverse=True)
        text = ", ".join(f"`{k}` {v:.0f} ({v / step:.0%})" for v, k in parts)
        lines.append(f"| {r['label']}, {r['size']} | {step:.0f} | {text} |")
    return "\n".join(lines)


def machine_block(machine: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"- CPU: {machine['cpu']}, {machine['cores']} cores, {machine['ram_gib']} GiB RAM, {machine['os']}",
            f"- Python {machine['python']}, torch {machine['torch']}, deepspeed {machine['deepspeed']}, "
            f"zeroshard {machine['zeroshard']}",
            f"- Date: {machine['date']}; the whole run took {machine.get('wall_minutes', '?')} minutes; "
            f"1-minute load average at its end: {machine['loadavg_1min']} (the machine is shared, see `load`)",
        ]
    )


_METHOD = """\
## How it is measured

- Every row is its own `torchrun --standalone --nproc_per_node N` process group; rows run one after
  another, frameworks alternating (DDP, zeroshard 0, DeepSpeed 1, zeroshard 1, ...).
- Same model (the GPT preset, `zeroshard.models.gpt.PRESETS`), same initial weights (seed), same
  global batch per step (seeded blocks of the Python stdlib source, `micro_batch` per rank), fp32,
  AdamW (lr 1e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1), no gradient clipping.
  DDP and FSDP2 use `torch.optim.AdamW(fused=True)`; zeroshard's `"AdamW"` resolves to the same kernel;
  DeepSpeed uses what its `"AdamW"` config gives on its CPU accelerator (its JIT-built FusedAdam op).
  DeepSpeed and zeroshard get the same ds_config (`overlap_comm`, `contiguous_gradients`, reduce and
  all-gather buckets of `bucket` elements: 6.25e6 = 25 MB of fp32 by default, DDP's own bucket size).
- Tokens per step are few (`micro_batch` x `seq_len` per rank) so the default run fits in 20 minutes on
  two cores: compute is a small share of each step, communication and optimizer a large one, which is
  the pessimistic case for a ZeRO engine. `--seq-len 128` gives a compute-heavier view.
- `torch.set_num_threads(threads)` in every rank (1 when two ranks share two cores), for all frameworks.
- Step time: wall time of `forward + backward + optimizer step` after a barrier, the slowest rank of
  each step; median and inter-quartile range over the timed steps, warm-up steps excluded (DeepSpeed's
  JIT op build happens in `deepspeed.initialize`, before any step).
- Peak RSS: `getrusage(RUSAGE_SELF).ru_maxrss` of each rank at the end (whole process lifetime; the
  worst rank is shown).
- Model states: bytes of parameters, gradients, fp32 master weights and optimizer state on one rank.
  DDP/FSDP2: measured from the tensors (local shards); zeroshard: `engine.memory_report()`;
  DeepSpeed: parameters, master partitions and optimizer state read from its optimizer, gradients
  from the formula (labelled). Offload rows include the states held in host memory (the same RAM here).
  "vs ZeRO formula": fp32 weights 4Ψ, gradients 4Ψ, Adam 8Ψ, and for
  ZeRO 1-3 the fp32 master partition 4Ψ/N: stage 0 16Ψ, stage 1 8Ψ+12Ψ/N, stage 2 4Ψ+16Ψ/N,
  stage 3 20Ψ/N, FSDP2 16Ψ/N.
- Communication: **measured** for every framework by a dispatch mode that sees each c10d collective
  (`benchmarks/workers/commcount.py`) during the last warm-up step, in ring-model bus bytes per rank
  (all-reduce 2S(N-1)/N, all-gather and reduce-scatter S(N-1)/N). For zeroshard the engine's own
  `comm_stats`, averaged over the timed steps, is shown next to it.
- load: the machine's 1-minute load average when the row ended. It is shared: other jobs running at the
  same time slow a row down, so compare rows with similar load, or pool runs with `--repeats`.
- Final loss: mean over ranks of the last step's loss; every row is compared with DDP's
  (fp32 tolerance {rtol:g} relative); a row that differs is marked **DIFFERS**, never dropped.
"""


def render(
    compared: list[Compared | Row],
    machine: dict[str, Any],
    command: str,
    plot_name: str | None,
    micro: str | None,
    settings: dict[str, Any],
) -> str:
    parts = [
        "# Benchmarks: zeroshard vs DDP, FSDP2 and DeepSpeed",
        "",
        "CPU figures are relative: compare ratios within one run, not absolute numbers across machines.",
        "",
        "## Machine",
        "",
        machine_block(machine),
        "",
        "## Command",
        "",
        "```",
        command,
        "```",
        "",
        "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()),
        "",
        "## Results",
        "",
        results_table(compared),
        "",
    ]
    if plot_name:
        parts += [f"![step time and per-rank memory by framework and stage]({plot_name})", ""]
    parts += ["## Targets (issue 4)", "", targets_table(compared), ""]
    profiled = profile_table(compared)
    if profiled:
        parts += ["## Where the time goes", "", profiled, ""]
    if micro:
        parts += [micro, ""]
    parts += [_METHOD.format(rtol=LOSS_RTOL)]
    return "\n".join(parts)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
