"""Loading a Hugging Face checkpoint into shards: seconds and peak RSS per rank, zeroshard next to transformers
and DeepSpeed, on the same synthetic checkpoint (issue 12).

    python -m benchmarks.load --layers 16 --hidden 1536 --world-size 2 --repeats 3 --json benchmarks/results/load.json
    python -m benchmarks.load --layers 8 --hidden 1024 --experts 16 --expert-intermediate 512   # a Qwen3-MoE

Saves a synthetic Llama (`LlamaConfig`, seeded random weights, fp32, sharded safetensors) into a temporary
folder, then runs each variant as its own `torchrun --standalone` process group of `benchmarks.load_worker`
(fresh processes, so each rank's VmHWM belongs to that variant alone):

- zeroshard: `with zeroshard.zero_init(): from_pretrained(folder)` + `zeroshard.initialize`, stage 3, no optimizer;
- zeroshard+AdamW: the same with an AdamW optimizer in the config;
- transformers: `from_pretrained(folder, dtype=float32)` on every rank, no engine;
- deepspeed: `HfDeepSpeedConfig` (stage 3) alive during `from_pretrained`, then `deepspeed.initialize`.

Seconds: from a barrier after all imports to a barrier after the load (and `initialize`), on rank 0, so the
slowest rank counts. Peak RSS: each rank's VmHWM from /proc/self/status at that point, shown as the growth
over its VmHWM right after the imports and as the absolute value; the worst rank is in the table, every rank
in the JSON, with RssAnon and RssFile. The fixed batch's first forward is timed and measured the same way after
the load: transformers' fp32 parameters can be views of the memory-mapped files, read on first touch, so for it
the load only finishes there; a second forward gives the steady state to compare with. Logits of every variant
on the fixed batch are compared with transformers' (1e-6 relative to the largest logit). With --repeats, each
variant runs that many times (the order of the variants turning each time): seconds are medians, peaks the
worst run. The checkpoint is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.launch import REPO_ROOT, env, last_error, run, torchrun
from benchmarks.load_worker import VARIANTS

LABELS = {
    "zeroshard": "zeroshard stage 3",
    "zeroshard-adamw": "zeroshard stage 3 + AdamW",
    "transformers": "transformers from_pretrained",
    "deepspeed": "DeepSpeed stage 3 (HfDeepSpeedConfig)",
}
REFERENCE = "transformers"
TOLERANCE = 1e-6


def make_checkpoint(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.load_worker", "make", "--folder", str(folder)]
    cmd += ["--layers", str(args.layers), "--hidden", str(args.hidden), "--intermediate", str(args.intermediate)]
    cmd += ["--vocab", str(args.vocab), "--shard-size", args.shard_size]
    cmd += ["--experts", str(args.experts), "--experts-per-token", str(args.experts_per_token)]
    cmd += ["--expert-intermediate", str(args.expert_intermediate)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env(args.threads), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the checkpoint failed:\n{done.stderr[-3000:]}")
    files = sorted(folder.glob("*.safetensors"))
    return {
        "numel": json.loads((folder / "numel.json").read_text())["numel"],
        "bytes": sum(f.stat().st_size for f in files),
        "files": len(files),
        "layers": args.layers,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "experts": args.experts,
        "experts_per_token": args.experts_per_token if args.experts else None,
        "expert_intermediate": args.expert_intermediate if args.experts else None,
    }


def run_variant(variant: str, args: argparse.Namespace, folder: Path, root: Path, repeat: int) -> dict[str, Any]:
    out = root / f"rows{repeat}"
    out.mkdir(exist_ok=True)
    log = root / f"{variant}-{repeat}.log"
    cmd = torchrun(
        "benchmarks.load_worker",
        args.world_size,
        ["load", "--variant", variant, "--folder", str(folder), "--out", str(out)],
    )
    code = run(cmd, log, threads=args.threads, timeout=args.timeout)
    ranks = [out / f"{variant}-rank{r}.json" for r in range(args.world_size)]
    if code != 0 or not all(p.exists() for p in ranks):
        return {"variant": variant, "error": "timed out" if code is None else last_error(log)}
    per_rank = [json.loads(p.read_text()) for p in ranks]
    return {
        "variant": variant,
        "seconds": per_rank[0]["seconds"],
        "peak_growth": max(r["vmhwm_peak"] - r["vmhwm_after_imports"] for r in per_rank),
        "peak": max(r["vmhwm_peak"] for r in per_rank),
        "forward_seconds": per_rank[0]["forward_seconds"],
        "second_forward_seconds": per_rank[0]["second_forward_seconds"],
        "forward_peak_growth": max(r["after_forward"]["VmHWM"] - r["vmhwm_after_imports"] for r in per_rank),
        "file_backed_growth": max(r["after_load"]["RssFile"] - r["after_imports"]["RssFile"] for r in per_rank),
        "ranks": per_rank,
        "logits": str(out / f"{variant}-logits.pt"),
    }


def compare_logits(rows: list[dict[str, Any]]) -> None:
    """Each row's logits against transformers': max |difference| over max |logit|."""
    import torch

    ref = next((r for r in rows if r["variant"] == REFERENCE and "error" not in r), None)
    expected = torch.load(ref["logits"]) if ref else None
    for row in rows:
        if "error" in row:
            continue
        got = torch.load(row.pop("logits"))  # the file goes with the temporary folder
        if expected is None:
            continue
        row["logits_rel_diff"] = float((got - expected).abs().max() / expected.abs().max())
        row["logits_match"] = row["logits_rel_diff"] <= TOLERANCE


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's repeats: median times, worst peaks, the largest logit difference; every run kept."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return {**failed[0], "runs": runs}
    out: dict[str, Any] = {"variant": runs[0]["variant"], "repeats": len(runs)}
    for key in ("seconds", "forward_seconds", "second_forward_seconds"):
        out[key] = statistics.median(r[key] for r in runs)
    for key in ("peak_growth", "peak", "forward_peak_growth", "file_backed_growth"):
        out[key] = max(r[key] for r in runs)
    if all("logits_rel_diff" in r for r in runs):
        out["logits_rel_diff"] = max(r["logits_rel_diff"] for r in runs)
        out["logits_match"] = all(r["logits_match"] for r in runs)
    out["runs"] = runs
    return out


def table(rows: list[dict[str, Any]], ckpt: dict[str, Any]) -> str:
    gb = ckpt["bytes"] / 1e9
    ref = next((r for r in rows if r["variant"] == REFERENCE and "error" not in r), None)
    lines = [
        f"Checkpoint: {ckpt['numel'] / 1e6:.0f}M parameters, fp32, {gb:.2f} GB in {ckpt['files']} safetensors files"
        + (
            f"; a Qwen3-MoE of {ckpt['experts']} experts per layer, stored one tensor per expert."
            if ckpt.get("experts")
            else "."
        ),
        "",
        f"Seconds: median of {rows[0].get('repeats', 1)} process groups per variant; peaks: the worst rank "
        "of the worst run.",
        "",
        "| variant | load s | vs transformers | peak RSS growth / rank GB | vs checkpoint | "
        "peak RSS / rank GB (absolute) | file-backed RSS growth at end GB | first forward s | "
        "peak RSS growth after first forward GB | vs checkpoint | second forward s | logits vs transformers |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {LABELS[r['variant']]} | failed: {r['error']} |" + " |" * 11)
            continue
        speed = f"{r['seconds'] / ref['seconds']:.2f}x" if ref else ""
        match = "" if "logits_match" not in r else ("equal" if r["logits_match"] else "**DIFFER**")
        match += f" ({r['logits_rel_diff']:.1e})" if "logits_rel_diff" in r else ""
        lines.append(
            f"| {LABELS[r['variant']]} | {r['seconds']:.1f} | {speed} | {r['peak_growth'] / 1e9:.2f} | "
            f"{r['peak_growth'] / ckpt['bytes']:.2f}x | {r['peak'] / 1e9:.2f} | {r['file_backed_growth'] / 1e9:.2f} | "
            f"{r['forward_seconds']:.1f} | {r['forward_peak_growth'] / 1e9:.2f} | "
            f"{r['forward_peak_growth'] / ckpt['bytes']:.2f}x | {r['second_forward_seconds']:.1f} | {match} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1536, help="a multiple of 128 (heads of 128)")
    parser.add_argument("--intermediate", type=int, default=0, help="MLP width; 0: 8/3 of hidden, rounded to 256")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-size", default="500MB", help="save_pretrained's max_shard_size")
    parser.add_argument("--experts", type=int, default=0, help="a Qwen3-MoE of this many experts per layer (0: Llama)")
    parser.add_argument("--experts-per-token", type=int, default=2)
    parser.add_argument("--expert-intermediate", type=int, default=512, help="each expert's MLP width")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process group")
    parser.add_argument("--repeats", type=int, default=1, help="process groups per variant; median seconds")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--keep", help="save the checkpoint here and keep it (default: a temporary folder)")
    parser.add_argument("--json", help="also write the machine, checkpoint and raw rows here")
    args = parser.parse_args(argv)

    from benchmarks.machine import describe

    with tempfile.TemporaryDirectory(prefix="zeroshard-load-bench-") as tmp:
        folder = Path(args.keep) if args.keep else Path(tmp) / "checkpoint"
        ckpt = make_checkpoint(args, folder)
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
        for repeat in range(args.repeats):  # the order turns each time: no variant always runs first
            turn = args.variants[repeat % len(args.variants) :] + args.variants[: repeat % len(args.variants)]
            rows = [run_variant(v, args, folder, Path(tmp), repeat) for v in turn]
            compare_logits(rows)
            for row in rows:
                runs[row["variant"]].append(row)
        rows = [combine(runs[v]) for v in args.variants]
    result = {
        "machine": describe(),
        "command": "python -m benchmarks.load " + " ".join(sys.argv[1:] if argv is None else argv),
        "checkpoint": ckpt,
        "world_size": args.world_size,
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(table(rows, ckpt))  # noqa: T201 - the table is this command's output


if __name__ == "__main__":
    main()
