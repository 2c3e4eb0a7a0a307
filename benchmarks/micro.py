"""Micro-benchmarks of the pieces, each next to its physical reference measured in the same run.

    python -m benchmarks.micro                 # prints the markdown section

- gloo all-gather / reduce-scatter bus bandwidth by message size through `zeroshard.comm.collectives`,
  against memory bandwidth (gloo on one machine moves bytes through memory);
- CPU Adam parameters/s: torch AdamW foreach vs fused, DeepSpeed's FusedAdam (CPU op) and
  DeepSpeedCPUAdam, against the bound memory bandwidth / 28 bytes per parameter (Adam reads
  param, grad, m, v and writes param, m, v: 7 x 4 bytes).
- NVMe swap GB/s of zeroshard's NvmeSwapper against the same disk's raw sequential bandwidth
  (`benchmarks/nvme_swap.py`, run small here).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import launch
from benchmarks.bandwidth import stream_bandwidth

ADAM_BYTES_PER_PARAM = 28


# -- collectives -----------------------------------------------------------------------------------
def collectives(results_dir: Path, world_size: int = 2, timeout: float = 600) -> dict[str, Any]:
    out = results_dir / "micro_collectives.json"
    out.unlink(missing_ok=True)
    log = results_dir / "micro_collectives.log"
    code = launch.run(
        launch.torchrun("benchmarks.workers.collectives", world_size, ["--out", str(out)]),
        log,
        threads=1,
        timeout=timeout,
    )
    if not out.exists():
        return {"error": f"exit code {code}: {launch.last_error(log)}"}
    return dict(json.loads(out.read_text()))


# -- Adam ------------------------------------------------------------------------------------------
def _adam_candidates(params: list[torch.nn.Parameter]) -> dict[str, Callable[[], torch.optim.Optimizer]]:
    hp: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    out: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "torch AdamW foreach": lambda: torch.optim.AdamW(params, foreach=True, **hp),
        "torch AdamW fused": lambda: torch.optim.AdamW(params, fused=True, **hp),
    }

    def ds_cpu_adam() -> torch.optim.Optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **hp)

    def ds_fused_adam() -> torch.optim.Optimizer:
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(params, adam_w_mode=True, **hp)

    out["DeepSpeedCPUAdam"] = ds_cpu_adam
    out["DeepSpeed FusedAdam (CPU op)"] = ds_fused_adam
    return out


def _step_time(optimizer: torch.optim.Optimizer, repeats: int = 5) -> float:
    """Best of `repeats` steps after two warm-up steps (state allocation, JIT op load)."""
    optimizer.step()
    optimizer.step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        optimizer.step()
        best = min(best, time.perf_counter() - start)
    return best


def adam(numel: int = 1 << 24, thread_counts: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Parameters/s of one Adam step over a flat fp32 tensor of `numel` elements, per implementation."""
    threads = thread_counts or tuple(sorted({1, os.cpu_count() or 1}))
    before = torch.get_num_threads()
    results: dict[str, Any] = {"numel": numel, "by_threads": {}}
    try:
        for t in threads:
            torch.set_num_threads(t)
            entry: dict[str, Any] = {"mem_bw": stream_bandwidth(), "params_per_s": {}, "notes": {}}
            entry["bound_params_per_s"] = entry["mem_bw"] / ADAM_BYTES_PER_PARAM
            param = torch.nn.Parameter(torch.randn(numel))
            param.grad = torch.randn(numel) * 1e-3
            for name, build in _adam_candidates([param]).items():
                try:
                    entry["params_per_s"][name] = numel / _step_time(build())
                except Exception as err:  # noqa: BLE001 - an optional DeepSpeed op that does not build is a note
                    entry["notes"][name] = f"skipped: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            results["by_threads"][str(t)] = entry
    finally:
        torch.set_num_threads(before)
    return results


# -- NVMe swap -------------------------------------------------------------------------------------
NVME_ARGS = ["--size-mb", "256", "--threads", "1,4", "--block-mb", "8", "--repeats", "2", "--no-buffered"]


def nvme(results_dir: Path, timeout: float = 300) -> dict[str, Any]:
    """`benchmarks.nvme_swap` (zeroshard's NvmeSwapper against raw sequential I/O on the same disk), small."""
    if importlib.util.find_spec("benchmarks.nvme_swap") is None:
        return {"error": "benchmarks/nvme_swap.py is not present"}
    out = results_dir / "micro_nvme.json"
    out.unlink(missing_ok=True)
    log = results_dir / "micro_nvme.log"
    code = launch.run(
        [sys.executable, "-m", "benchmarks.nvme_swap", *NVME_ARGS, "--json", str(out)], log, threads=1, timeout=timeout
    )
    if not out.exists():
        return {"error": f"exit code {code}: {launch.last_error(log)}"}
    return dict(json.loads(out.read_text()))


def _nvme_markdown(result: dict[str, Any] | None) -> str:
    if not result or "error" in result:
        reason = (result or {}).get("error", "not run")
        return f"NVMe swap bandwidth: not measured ({reason})."
    try:
        from benchmarks.nvme_swap import markdown as nvme_markdown

        table = nvme_markdown(result)
    except Exception as err:  # noqa: BLE001 - another module's format; the page must still render
        return f"NVMe swap bandwidth: measured, but its table could not be rendered ({type(err).__name__}: {err})."
    return "NVMe swap, `python -m benchmarks.nvme_swap " + " ".join(NVME_ARGS) + "`:\n\n" + table


# -- report ----------------------------------------------------------------------------------------
def run_all(results_dir: Path) -> dict[str, Any]:
    return {"collectives": collectives(results_dir), "adam": adam(), "nvme": nvme(results_dir)}


def markdown(results: dict[str, Any]) -> str:
    lines = ["## Micro-benchmarks", ""]
    coll = results.get("collectives", {})
    if "sizes" in coll:
        one, all_ = coll["mem_bw_one_rank"] / 1e9, coll["mem_bw_all_ranks"] / 1e9
        lines += [
            f"Collectives through `zeroshard.comm.collectives.Collectives`, gloo, {coll['world_size']} ranks, "
            "1 thread per rank; bus bandwidth = S·(N-1)/N / time.",
            f"Physical reference, same run: memory bandwidth (in-place add, `benchmarks/bandwidth.py`) "
            f"{one:.1f} GB/s for one rank alone, {all_:.1f} GB/s summed over both ranks at once.",
            "Times are the best of several iterations (the machine is shared; best-of shows capability).",
            "",
            "| message S | all-gather ms | all-gather bus GB/s | reduce-scatter ms | reduce-scatter bus GB/s "
            "| bus BW / one-rank memory BW |",
            "|---|---|---|---|---|---|",
        ]
        for r in coll["sizes"]:
            frac = max(r["all_gather_busbw"], r["reduce_scatter_busbw"]) / coll["mem_bw_one_rank"]
            lines.append(
                f"| {_size(r['bytes'])} | {r['all_gather_s'] * 1e3:.2f} | {r['all_gather_busbw'] / 1e9:.2f} "
                f"| {r['reduce_scatter_s'] * 1e3:.2f} | {r['reduce_scatter_busbw'] / 1e9:.2f} | {frac:.0%} |"
            )
    else:
        lines.append(f"Collectives: not measured ({coll.get('error', 'no result')}).")
    lines.append("")
    ad = results.get("adam", {})
    if ad:
        lines += [
            f"CPU Adam, one step over a flat fp32 tensor of {ad['numel'] / 1e6:.1f} M elements "
            f"(bound: memory bandwidth / {ADAM_BYTES_PER_PARAM} bytes per parameter), best of 5 steps. "
            "The bound is approximate: Adam streams four arrays in and three out, the reference two in "
            "and one out, so a kernel can land somewhat above it.",
            "",
        ]
        lines += ["| threads | implementation | M params/s | % of bound |", "|---|---|---|---|"]
        for t, entry in ad["by_threads"].items():
            bound = entry["bound_params_per_s"]
            lines.append(f"| {t} | bound (memory {entry['mem_bw'] / 1e9:.1f} GB/s / 28 B) | {bound / 1e6:.0f} | 100% |")
            for name, rate in entry["params_per_s"].items():
                lines.append(f"| {t} | {name} | {rate / 1e6:.0f} | {rate / bound:.0%} |")
            for name, note in entry["notes"].items():
                lines.append(f"| {t} | {name} | {note} | |")
    lines += ["", _nvme_markdown(results.get("nvme"))]
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.micro", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results-dir", default=None, help="where to keep the JSON (default: a temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results_dir = Path(args.results_dir or tmp)
        results_dir.mkdir(parents=True, exist_ok=True)
        results = run_all(results_dir)
        (results_dir / "micro.json").write_text(json.dumps(results, indent=1))
        print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
