"""Resident memory per rank as the OS counts it (VmHWM), stage 0 against stage 3, with and without the
library's host allocator policy ([Note: glibc's mmap threshold] in src/zeroshard/offload/host_memory.py).

    python -m benchmarks.resident_memory                     # markdown table on stdout
    python -m benchmarks.resident_memory --json results.json --steps 10

A ~25M-parameter GPT (fp32, AdamW) on 2 gloo ranks on the CPU, one fresh pair of processes per row. Each rank
reads its own VmHWM from /proc/self/status after imports and a warm-up step of a tiny model through the same
engine (the baseline), then
builds the model and the engine and trains; `growth` is the final VmHWM minus the baseline, `rss` the VmRSS after
each step. Rows: stage 0; stage 3 with `stage3_max_live_parameters` and `stage3_max_reuse_distance` of about one
block (as users set them to save memory); stage 3 with DeepSpeed's defaults (1e9 each: this small model stays
gathered, as in DeepSpeed). Every row runs with the policy (ZEROSHARD_HOST_ALLOC=fixed: stage 0 too, which
by default leaves glibc alone); `--without-fix` (ZEROSHARD_HOST_ALLOC=glibc) leaves glibc's dynamic mmap
threshold alone everywhere; the policy is not applied either when MALLOC_MMAP_THRESHOLD_ is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.harness import run_on_ranks  # noqa: E402

MiB = 1 << 20
WORLD_SIZE = 2
# 25.3M parameters (16 bytes each with AdamW in fp32: 386 MiB of model states unsharded); one block is 3.15M
MODEL = {"vocab_size": 12288, "block_size": 128, "n_layer": 6, "n_head": 8, "n_embd": 512, "bias": True}
BLOCK_NUMEL = 12 * 512 * 512 + 13 * 512
CASES: dict[str, dict[str, Any]] = {
    "stage 0": {"stage": 0},
    "stage 3, one block live": {
        "stage": 3,
        "stage3_max_live_parameters": BLOCK_NUMEL,
        "stage3_max_reuse_distance": BLOCK_NUMEL,
        "stage3_prefetch_bucket_size": BLOCK_NUMEL,
    },
    "stage 3, DeepSpeed defaults": {"stage": 3},  # max_live_parameters and max_reuse_distance 1e9
}


def proc_status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmHWM: the peak resident set; VmRSS: the resident set now)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _config(zero: dict[str, Any], micro: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": {"overlap_comm": True, **zero},
    }


def measure(rank: int, world_size: int, zero: dict[str, Any], steps: int, micro: int) -> dict[str, Any]:
    """One rank: VmHWM growth over building and training the 25M model, VmRSS after every step."""
    import torch

    import zeroshard
    from zeroshard.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(**MODEL)
    # warm-up: a tiny model through the same engine, so that lazy imports, process groups and kernels' first-use
    # buffers are in the baseline, as the interpreter and torch are
    tiny = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    engine, _, _, _ = zeroshard.initialize(model=tiny, config=_config(zero, 1))
    x = torch.zeros(1, 16, dtype=torch.long)
    engine.backward(engine(x, x))
    engine.step()
    engine.destroy()
    del engine, tiny
    baseline = proc_status("VmHWM")

    torch.manual_seed(0)
    model = GPT(cfg)
    numel = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = zeroshard.initialize(model=model, config=_config(zero, micro))
    generator = torch.Generator().manual_seed(1 + rank)
    rss, losses = [], []
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (micro, cfg.block_size), generator=generator)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        rss.append(proc_status("VmRSS"))
    report = engine.memory_report()
    return {
        "numel": numel,
        "baseline": baseline,
        "growth": proc_status("VmHWM") - baseline,
        "rss": rss,
        "model_states": report.model_states,
        "peak_gathered_params": report.peak_gathered_params,
        "losses": losses,
    }


def run_case(name: str, steps: int, micro: int, without_fix: bool) -> list[dict[str, Any]]:
    """Every rank's `measure` for CASES[name], in a fresh pair of processes (they inherit the environment)."""
    previous = os.environ.get("ZEROSHARD_HOST_ALLOC")
    # one policy for every row: by default stages 0-2 leave glibc alone ([Note: glibc's mmap threshold]), so the
    # policy rows force it (`fixed`) for stage 0 too; stage 0 under the library's default is the glibc row
    os.environ["ZEROSHARD_HOST_ALLOC"] = "glibc" if without_fix else "fixed"
    try:
        return run_on_ranks(measure, WORLD_SIZE, CASES[name], steps, micro)
    finally:
        if previous is None:
            os.environ.pop("ZEROSHARD_HOST_ALLOC", None)
        else:
            os.environ["ZEROSHARD_HOST_ALLOC"] = previous


def _table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| allocator | case | VmHWM growth MiB/rank (max) | / stage 0 | RSS after step 1, 5, last (MiB, rank 0) "
        "| model states MiB (memory_report) |",
        "|---|---|---:|---:|---|---:|",
    ]
    for row in rows:
        ranks = row["ranks"]
        growth = max(r["growth"] for r in ranks)
        stage0 = next(x for x in rows if x["fix"] == row["fix"] and x["case"] == "stage 0")
        ratio = growth / max(r["growth"] for r in stage0["ranks"])
        rss = ranks[0]["rss"]
        picks = ", ".join(f"{rss[i] / MiB:.0f}" for i in (0, min(4, len(rss) - 1), len(rss) - 1))
        out.append(
            f"| {'policy' if row['fix'] else 'glibc default'} | {row['case']} | {growth / MiB:.0f} | {ratio:.2f} "
            f"| {picks} | {ranks[0]['model_states'] / MiB:.0f} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro", type=int, default=2, help="micro-batch per rank (sequences of 128 tokens)")
    parser.add_argument("--without-fix", action="store_true", help="only the rows with glibc's default")
    parser.add_argument("--with-fix-only", action="store_true", help="only the rows with the policy")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    fixes = [False] if args.without_fix else [True] if args.with_fix_only else [True, False]
    rows = [
        {"fix": fix, "case": name, "ranks": run_case(name, args.steps, args.micro, without_fix=not fix)}
        for fix in fixes
        for name in CASES
    ]
    machine = describe()
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    numel = rows[0]["ranks"][0]["numel"]
    print(
        f"{numel / 1e6:.1f}M parameters, fp32, AdamW, {WORLD_SIZE} ranks, {args.steps} steps, micro-batch {args.micro}"
    )
    print(f"machine: {machine}\n")
    print(_table(rows))


if __name__ == "__main__":
    main()
