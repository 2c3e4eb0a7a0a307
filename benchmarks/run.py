"""Train the same GPT under DDP, FSDP2, DeepSpeed ZeRO-1/2/3 and zeroshard, and write docs/benchmarks.md.

    python -m benchmarks.run                                  # default: 20m and 120m, 2 ranks (< 20 min here)
    python -m benchmarks.run --quick --out /tmp/b/bench.md    # tiny model, fast rows only (~1 min)
    python -m benchmarks.run --sizes 20m --world-sizes 2,4 --frameworks ddp,zeroshard --steps 14
    python -m benchmarks.run --preset overhead                # issue 21's per-step overhead table (~10 min)
    python -m benchmarks.run --preset lora                    # LoRA on the 120m GPT (docs/benchmarks_lora.md)

Each row (framework x stage x size x ranks) runs in its own `torchrun` process group; its rank 0
writes a JSON file into --results-dir, which this process aggregates into the page and plot.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import analysis, launch, machine, plot, report
from benchmarks.spec import FRAMEWORKS, VARIANTS, RowSpec, TrainSettings, Variant

# Named row sets: their options go before the command line's, so an explicit option still wins.
PRESETS: dict[str, list[str]] = {
    # per-step overhead where compute is small (issue 21): a 5.3M-parameter GPT at its 128-token block and the 20m
    # preset at its 256-token block, micro-batch 2 per rank, every framework and stage side by side
    "overhead": [
        "--sizes=5m,20m",
        "--seq-len=0",
        "--micro-batch=2",
        "--steps=22",
        "--warmup=2",
        "--variants=ddp,zs0,ds1,zs1,ds2,zs2,fsdp2,ds3,zs3,zs3g",
        "--no-micro",
    ],
    # engine.compile() (inductor) against the eager engine, same rows otherwise: the 20m GPT at 256 tokens
    "compile": [
        "--sizes=20m",
        "--seq-len=256",
        "--micro-batch=2",
        "--steps=13",
        "--warmup=3",
        "--variants=zs0,zs0c,zs2,zs2c,zs3,zs3c",
        "--no-micro",
        "--out=docs/benchmarks_compile.md",
    ],
    # LoRA (rank 16 on every block's linear layers, everything else frozen) on the 120m GPT: what a frozen base
    # costs each framework in memory and bytes on the wire ([Note: frozen parameters at stage 3]). Persistence 0
    # keeps the adapters in their blocks' units, as at 7B+ sizes, where an adapter matrix passes the 1e5 default
    "lora": [
        "--sizes=120m",
        "--seq-len=128",
        "--lora-rank=16",
        "--steps=8",
        "--variants=ddp,ds2,zs2,fsdp2,ds3,zs3,zs3f",
        '--zero-config={"stage3_param_persistence_threshold": 0}',
        "--no-micro",
        "--out=docs/benchmarks_lora.md",
    ],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    preset = next((a.split("=", 1)[1] for a in argv if a.startswith("--preset=")), None)
    if "--preset" in argv and argv.index("--preset") + 1 < len(argv):
        preset = argv[argv.index("--preset") + 1]
    if preset is not None and preset not in PRESETS:
        raise SystemExit(f"unknown --preset {preset!r}; presets: {', '.join(PRESETS)}")
    if preset is not None:
        argv = PRESETS[preset] + argv
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default=None, help="GPT presets, comma-separated (default 20m,120m; quick: tiny)")
    p.add_argument("--world-sizes", default="2", help="ranks per row, comma-separated (default 2)")
    p.add_argument("--steps", type=int, default=12, help="steps per row, warm-up included (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (default 2)")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per rank per step (default 1)")
    p.add_argument(
        "--seq-len",
        type=int,
        default=32,
        help="tokens per sample, at most the preset's block size, 0 for the block size (default 32: keeps the default "
        "run under 20 minutes on 2 busy cores; the parameter count, hence ZeRO's work, is unchanged)",
    )
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="subset of " + ",".join(FRAMEWORKS))
    p.add_argument(
        "--variants",
        default=None,
        help="explicit row keys (" + ",".join(v.key for v in VARIANTS) + "); overrides --frameworks",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="peft LoRA adapters of this rank on every block's linear layers, all else frozen (default 0: none)",
    )
    p.add_argument("--repeats", type=int, default=1, help="run the whole row list this many times, pooled")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (default cores / ranks)")
    p.add_argument(
        "--bucket",
        type=float,
        default=6.25e6,
        help="ZeRO reduce/all-gather bucket in elements, DeepSpeed and zeroshard alike (default 6.25e6: "
        "25 MB of fp32, DDP's default bucket, the fastest of 2e6/6.25e6/2.5e7/1e8 here)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="after timing, profile this many more steps of the DDP, FSDP2 and zeroshard rows of the first "
        "size (<row>.profile.txt in --results-dir; default 3, 0 with --quick)",
    )
    p.add_argument(
        "--zero-config",
        type=json.loads,
        default={},
        help="JSON merged into zero_optimization for DeepSpeed and zeroshard rows alike, "
        "e.g. '{\"reduce_scatter\": false}'",
    )
    p.add_argument(
        "--optimizer",
        type=json.loads,
        default=None,
        help="JSON optimizer block replacing AdamW for DeepSpeed and zeroshard rows alike (DDP and FSDP2 rows train "
        'torch\'s AdamW, so they are refused with it), e.g. \'{"type": "Muon", "params": {"lr": 0.02}}\'',
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a named set of options (overhead: issue 21's small-model table, 5m at 128 tokens and 20m at 256, "
        "micro-batch 2, 20 timed steps, DDP/FSDP2/DeepSpeed/zeroshard stages 0-3; compile: zeroshard stages 0, 2 "
        "and 3 eager and with engine.compile(), 20m at 256 tokens; lora: LoRA rank 16 on the 120m GPT at 128 "
        "tokens, DDP/FSDP2/DeepSpeed/zeroshard stages 2-3); later options override it",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 2 ranks, fast rows only")
    p.add_argument(
        "--micro",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the micro-benchmarks (default: on, off with --quick)",
    )
    p.add_argument("--out", default="docs/benchmarks.md", help="results page (the plot goes next to it)")
    p.add_argument("--results-dir", default="benchmarks/results", help="row JSON files and logs")
    p.add_argument("--row-timeout", type=float, default=900.0, help="seconds before a row is killed")
    p.add_argument(
        "--from-results",
        default=None,
        metavar="DIR",
        help="run nothing: render the page and plot again from DIR/summary.json",
    )
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = "tiny" if args.quick else "20m,120m"
    if args.micro is None:
        args.micro = not args.quick
    if args.profile_steps is None:
        args.profile_steps = 0 if args.quick else 3
    if args.steps - args.warmup < 1 or args.warmup < 1:
        p.error("need --warmup >= 1 and at least one timed step")
    return args


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def selected_variants(args: argparse.Namespace) -> list[Variant]:
    if args.variants:
        keys = _csv(args.variants)
        unknown = sorted(set(keys) - {v.key for v in VARIANTS})
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; known: {[v.key for v in VARIANTS]}")
        return [v for v in VARIANTS if v.key in keys]
    frameworks = set(_csv(args.frameworks))
    return [v for v in VARIANTS if v.framework in frameworks and v.by_default]


def plan(args: argparse.Namespace) -> list[RowSpec]:
    """Rows in run order: per ranks and size, the variants in table order (frameworks alternate)."""
    cores = os.cpu_count() or 1
    rows = []
    sizes = _csv(args.sizes)
    for n in (int(x) for x in _csv(args.world_sizes)):
        threads = args.threads or max(1, cores // n)
        for size in sizes:
            settings = TrainSettings(
                size=size,
                micro_batch=args.micro_batch,
                seq_len=args.seq_len,
                steps=args.steps,
                warmup=args.warmup,
                bucket_numel=int(args.bucket),
                threads=threads,
                lora_rank=args.lora_rank,
            )
            for v in selected_variants(args):
                extra: dict[str, Any] = {"zero_overrides": args.zero_config} if args.zero_config else {}
                if args.optimizer:
                    if v.framework not in ("zeroshard", "deepspeed"):
                        raise SystemExit(f"--optimizer applies to DeepSpeed and zeroshard rows; drop {v.key}")
                    extra["optimizer"] = args.optimizer
                if args.profile_steps and size == sizes[0] and v.framework in ("ddp", "zeroshard", "fsdp2"):
                    extra["profile_steps"] = args.profile_steps
                rows.append(RowSpec(v, settings, n, extra))
    return rows


# -- rows that are not launched ---------------------------------------------------------------------
def deepspeed_ops_built(offload: bool) -> bool:
    """Whether DeepSpeed's JIT ops for this row are already compiled (no ~75 s build in a quick run)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return False
    name = "cpu_adam" if offload else "fused_adam"
    return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()


def _unimplemented(keys: tuple[str, ...]) -> list[str]:
    from zeroshard.config.support import is_unimplemented

    return [k for k in keys if is_unimplemented(k)]


def reason_not_to_launch(spec: RowSpec, quick: bool) -> tuple[str, str] | None:
    """(status, note) for a row that is reported without running it, else None."""
    v = spec.variant
    if v.framework == "zeroshard" and _unimplemented(v.needs):
        return "not implemented", f"zeroshard lists {', '.join(_unimplemented(v.needs))} as not implemented yet"
    if v.framework == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            return "skipped", "deepspeed is not installed (make install-compat)"
        if quick and not deepspeed_ops_built(v.offload):
            return "skipped", "--quick: DeepSpeed's JIT ops are not built yet (run a full benchmark once)"
        twin = next(
            (t for t in VARIANTS if t.framework == "zeroshard" and t.stage == v.stage and t.offload == v.offload), None
        )
        if v.offload and twin is not None and _unimplemented(twin.needs):
            return "skipped", "runs together with zeroshard's offload row, which is not implemented yet"
    return None


def stub(spec: RowSpec, status: str, note: str) -> dict[str, Any]:
    v = spec.variant
    return {
        "status": status,
        "note": note,
        "row_id": spec.row_id,
        "variant": v.key,
        "label": v.label,
        "framework": v.framework,
        "stage": v.stage,
        "offload": v.offload,
        "size": spec.settings.size,
        "world_size": spec.world_size,
    }


# -- launching ------------------------------------------------------------------------------------
def launch_row(spec: RowSpec, results_dir: Path, timeout: float, tag: str = "") -> dict[str, Any]:
    """Run one row under torchrun; any failure becomes a row with status "error" and the log's tail."""
    base = results_dir / f"{spec.row_id}{tag}"
    spec_path, out_path, log_path = (Path(f"{base}.spec.json"), Path(f"{base}.json"), Path(f"{base}.log"))
    spec_path.write_text(spec.to_json())
    out_path.unlink(missing_ok=True)
    args = ["--spec", str(spec_path), "--out", str(out_path)]
    cmd = launch.torchrun("benchmarks.workers.main", spec.world_size, args)
    code = launch.run(cmd, log_path, spec.settings.threads, timeout)
    if out_path.exists():
        return dict(json.loads(out_path.read_text()))
    if code is None:
        return stub(spec, "error", f"killed after {timeout:.0f} s (log: {log_path})")
    return stub(spec, "error", f"exit code {code}: {launch.last_error(log_path)} (log: {log_path})")


def run_rows(specs: list[RowSpec], args: argparse.Namespace, results_dir: Path) -> list[dict[str, Any]]:
    """Every row `--repeats` times (the whole list per repeat, so frameworks alternate), merged per row."""
    runs: dict[str, list[dict[str, Any]]] = {s.row_id: [] for s in specs}
    for repeat in range(args.repeats):
        for spec in specs:
            skip = reason_not_to_launch(spec, args.quick)
            if skip is not None:
                if repeat == 0:
                    runs[spec.row_id].append(stub(spec, *skip))
                    print(f"[bench] {spec.row_id:24s} {skip[0]}: {skip[1]}", flush=True)
                continue
            start = time.time()
            tag = f".r{repeat}" if args.repeats > 1 else ""
            row = launch_row(spec, results_dir, args.row_timeout, tag)
            runs[spec.row_id].append(row)
            print(f"[bench] {spec.row_id:24s} {_one_line(row)}  ({time.time() - start:.0f} s)", flush=True)
    return [analysis.merge_repeats(r) for r in runs.values() if r]


def _one_line(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('note', '')}"
    return (
        f"step {row['step_time_median']:.3f} s  rss {max(row['peak_rss']) / 2**20:.0f} MiB  "
        f"faults/step {max(row.get('minor_faults_per_step', [0])):.0f}  loss {row['final_loss']:.6f}"
    )


def collect(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Run every row (and the micro-benchmarks); the summary the page is rendered from."""
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    specs = plan(args)
    rows = run_rows(specs, args, results_dir)
    micro_results = None
    if args.micro:
        from benchmarks import micro

        micro_results = micro.run_all(results_dir)
    s = specs[0].settings if specs else None
    settings = (
        {}
        if s is None
        else {
            "micro_batch": s.micro_batch,
            "seq_len": s.seq_len,
            "steps": s.steps,
            "warmup": s.warmup,
            "threads/rank": s.threads,
            "bucket": s.bucket_numel,
            "lora_rank": s.lora_rank,
            "repeats": args.repeats,
            "zero_config": json.dumps(args.zero_config),
            "optimizer": json.dumps(args.optimizer) if args.optimizer else "AdamW",
            "profile_steps": args.profile_steps,
        }
    )
    wall = time.time() - started
    command = " ".join(["python -m benchmarks.run", shlex.join(argv)]).strip()
    summary = {
        "machine": {**machine.describe(), "wall_minutes": round(wall / 60, 1)},
        "command": command,
        "settings": settings,
        "rows": rows,
        "micro": micro_results,
        "wall_s": wall,
    }
    (results_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def publish(summary: dict[str, Any], out: Path) -> None:
    """Write the page and its plot from a summary; print the tables."""
    rows = summary["rows"]
    compared = analysis.compare(rows)
    plot_path = out.with_suffix(".png")
    has_plot = plot.plot(rows, plot_path)
    micro_md = None
    if summary.get("micro"):
        from benchmarks import micro

        micro_md = micro.markdown(summary["micro"])
    from benchmarks import infinity

    infinity_md = infinity.page_section(Path(__file__).parent / "results")
    if infinity_md:  # recorded by its own, much longer, run (python -m benchmarks.infinity)
        micro_md = "\n\n".join(part for part in (micro_md, infinity_md) if part)
    text = report.render(
        compared,
        summary["machine"],
        summary["command"],
        plot_path.name if has_plot else None,
        micro_md,
        summary.get("settings", {}),
    )
    report.write(out, text)
    print(report.results_table(compared))
    print(report.targets_table(compared))
    print(f"[bench] wrote {out}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.from_results:
        summary = json.loads((Path(args.from_results) / "summary.json").read_text())
    else:
        summary = collect(args, argv)
    publish(summary, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
