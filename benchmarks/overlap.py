"""Overlap checked, not assumed (issue 13 item 4): how much of a step's communication and host-to-device copying
runs while no compute kernel does.

    make overlap-gpu                                   # = python -m benchmarks.overlap --json overlap.json
    python -m benchmarks.overlap --size 120m --trace-dir traces/

On a CUDA machine: one stage-3 step on every GPU (NCCL all-gathers and reduce-scatters; with one GPU there is
nothing to communicate, so this row needs two) and one step with parameters and optimizer offloaded to the CPU on
one GPU (H2D copies of parameter shards, D2H copies of gradients). Each step is profiled with torch.profiler after
two warm-up steps; the trace's device events are split into compute kernels, NCCL kernels and memcpys, and

    exposed = |union(comm) - union(compute)|,   exposed fraction = exposed / |union(comm)|

is reported per kind (a fraction of 0 means every byte moved while some kernel computed; 1 means none did), with the
step time and the share of the step the exposed time takes; the same for the host's optimizer step (its
`record_function` ranges: the main thread's after backward, and with `super_offload` the worker thread's during it,
[Note: speculative host steps]); the optimizer-offload row is repeated without clipping, and then with
super_offload. The traces are small (one step) and kept with `--trace-dir`. Without CUDA the script says so and
exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.harness import run_on_ranks  # noqa: E402

Interval = tuple[float, float]
SIZES = {  # zeroshard.models.gpt shapes (fp32 AdamW; bf16 compute)
    "20m": {"vocab_size": 8192, "block_size": 256, "n_layer": 6, "n_head": 8, "n_embd": 448},
    "120m": {"vocab_size": 50304, "block_size": 512, "n_layer": 12, "n_head": 12, "n_embd": 768},
    "350m": {"vocab_size": 50304, "block_size": 1024, "n_layer": 24, "n_head": 16, "n_embd": 1024},
}


# host ranges of the optimizer step: the main thread's after backward, and super_offload's worker's during it
HOST_STEP = ("zeroshard.optimizer_step", "zeroshard.speculative_step")


def classify(event: dict[str, Any]) -> str | None:
    """A chrome-trace event: on the device "comm" (NCCL kernels), "h2d"/"d2h" (memcpys), "compute" (other
    kernels); on the host "host_step" (the optimizer step's `record_function` ranges, `HOST_STEP`) and "backward"
    (`engine.backward`'s); or None (other host events, memsets, other annotations)."""
    category, name = event.get("cat", ""), str(event.get("name", ""))
    if event.get("ph") != "X" or "dur" not in event:
        return None
    if category == "user_annotation":
        return "host_step" if name in HOST_STEP else "backward" if name == "zeroshard.backward" else None
    if category == "gpu_memcpy":
        return "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else None
    if category != "kernel":
        return None
    return "comm" if "nccl" in name.lower() else "compute"


def union(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Total length of the intersection of two unions (each sorted, non-overlapping)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def exposed(trace: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per kind ("comm", "h2d", "d2h", "host_step"): busy microseconds, exposed microseconds (while no compute
    kernel ran) and the exposed fraction; for the host step also the microseconds outside `engine.backward`."""
    by_kind: dict[str, list[Interval]] = {k: [] for k in ("compute", "comm", "h2d", "d2h", "host_step", "backward")}
    for event in trace.get("traceEvents", []):
        kind = classify(event)
        if kind is not None:
            start = float(event["ts"])
            by_kind[kind].append((start, start + float(event["dur"])))
    compute = union(by_kind["compute"])
    out = {}
    for kind in ("comm", "h2d", "d2h", "host_step"):
        busy = union(by_kind[kind])
        total = length(busy)
        hidden = overlap(busy, compute)
        out[kind] = {
            "busy_us": total,
            "exposed_us": total - hidden,
            "exposed_fraction": (total - hidden) / total if total else 0.0,
        }
    host_step = union(by_kind["host_step"])  # a host-bound step exposes it anyway: how much still follows backward
    out["host_step"]["after_backward_us"] = length(host_step) - overlap(host_step, union(by_kind["backward"]))
    return out


def _profiled_step(
    rank: int,
    world_size: int,
    shape: dict[str, int],
    zero: dict[str, Any],
    trace_dir: str,
    ops_rows: int = 0,
    clipping: float = 1.0,
):
    import torch
    from torch.profiler import ProfilerActivity, profile

    import zeroshard
    from zeroshard.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(**shape)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": clipping,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "zero_optimization": {"overlap_comm": True, **zero},
    }
    engine, _, _, _ = zeroshard.initialize(model=GPT(cfg), config=config)
    generator = torch.Generator().manual_seed(rank)

    def step() -> None:
        x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=generator).to(engine.device)
        engine.backward(engine(x, x))
        engine.step()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], experimental_config=_all_threads()) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    named = "-".join(f"{k}{v}" for k, v in sorted(zero.items()) if k != "stage").replace(" ", "").replace("'", "")
    path = Path(trace_dir) / f"{named}-rank{rank}.json"
    prof.export_chrome_trace(str(path))
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ops_rows) if ops_rows else ""
    return {"step_s": seconds, "trace": str(path), "ops": ops, **exposed(json.loads(path.read_text()))}


def _all_threads() -> Any:
    """The profiler's config that records every thread's ranges (super_offload's worker thread's too), where this
    torch has it; else None (the main thread's only: the host-step columns then miss the worker)."""
    from torch._C._profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        print("benchmarks.overlap: this torch profiles one thread; super_offload's worker is not in the traces")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="120m")
    parser.add_argument("--trace-dir", type=Path, default=None, help="keep the chrome traces here")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--ops", type=int, default=0, help="print the N host ops with the most self CPU time")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.overlap: needs a CUDA GPU (it profiles NCCL and memcpy kernels); none here", file=sys.stderr)
        raise SystemExit(2)
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="zeroshard-overlap-"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    shape = SIZES[args.size]
    rows = []
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        zero = {"stage": 3}
        rows.append(
            {"case": f"stage 3, {gpus} GPUs", "ranks": run_on_ranks(_profiled_step, gpus, shape, zero, str(trace_dir))}
        )
    pinned = {"device": "cpu", "pin_memory": True}  # pageable memory makes every H2D copy synchronous
    offload = {"stage": 3, "offload_param": pinned, "offload_optimizer": pinned}
    # [Note: speculative host steps]: one unit per sub-group, no clipping (else nothing is stepped during backward)
    unit_sub_groups = {"stage": 3, "offload_optimizer": pinned, "sub_group_size": 1}
    speculating = {**unit_sub_groups, "offload_optimizer": {**pinned, "super_offload": True}}
    for case, zero, clipping in (
        ("stage 3, params+optimizer on CPU, 1 GPU", offload, 1.0),
        ("stage 3, optimizer on CPU, 1 GPU", {"stage": 3, "offload_optimizer": pinned}, 1.0),
        ("the same, one unit per sub-group, no clipping", unit_sub_groups, 0.0),
        ("the same with super_offload", speculating, 0.0),
    ):
        ranks = run_on_ranks(_profiled_step, 1, shape, zero, str(trace_dir), args.ops, clipping)
        rows.append({"case": case, "ranks": ranks})
    result = {"machine": describe(), "size": args.size, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"GPT {args.size}, bf16, one profiled step after two warm-up steps; machine: {result['machine']}\n")
    kinds = ("comm", "h2d", "d2h", "host_step")
    head = "| case | step s | NCCL busy ms | exposed | H2D busy ms | exposed | D2H busy ms | exposed |"
    print(f"{head} host optimizer step ms | exposed | after backward ms | exposed copies+comm / step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        r = row["ranks"][0]
        exposed_us = sum(r[k]["exposed_us"] for k in ("comm", "h2d", "d2h"))
        cells = [f"{r[k]['busy_us'] / 1e3:.1f} | {r[k]['exposed_fraction']:.2f}" for k in kinds]
        cells.append(f"{r['host_step']['after_backward_us'] / 1e3:.1f}")
        print(f"| {row['case']} | {r['step_s']:.3f} | {' | '.join(cells)} | {exposed_us / 1e6 / r['step_s']:.2f} |")
    for row in rows:
        if row["ranks"][0]["ops"]:
            print(f"\n{row['case']}, rank 0, host ops by self CPU time:\n{row['ranks'][0]['ops']}")
    print(f"\ntraces: {trace_dir}")


if __name__ == "__main__":
    main()
