"""Entry point of one benchmark row, run by torchrun on every rank:

    torchrun --standalone --nproc_per_node 2 -m benchmarks.workers.main --spec row.json --out result.json

Rank 0 writes the row's JSON (`status` "ok", or "not implemented" / "skipped" with a `note`).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.spec import RowSpec
from benchmarks.workers.common import (
    Batches,
    NotImplementedRow,
    RankResult,
    Trainer,
    build_model,
    summarize,
    time_steps,
    write_json,
)


def init_process_group(framework: str) -> None:
    if framework == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")


def build_trainer(spec: RowSpec, model: torch.nn.Module) -> Trainer:
    framework = spec.variant.framework
    if framework == "ddp":
        from benchmarks.workers.torch_native import build_ddp

        return build_ddp(model, spec.settings)
    if framework == "fsdp2":
        from benchmarks.workers.torch_native import build_fsdp2

        return build_fsdp2(model, spec.settings)
    if framework == "deepspeed":
        from benchmarks.workers.deepspeed_worker import DeepSpeedTrainer

        return DeepSpeedTrainer(model, spec)
    if framework == "zeroshard":
        from benchmarks.workers.zeroshard_worker import ZeroshardTrainer

        return ZeroshardTrainer(model, spec)
    raise ValueError(f"unknown framework {framework!r}")


def _not_run(spec: RowSpec, status: str, note: str) -> dict[str, Any]:
    return {
        "status": status,
        "note": note,
        "row_id": spec.row_id,
        "variant": spec.variant.key,
        "label": spec.variant.label,
        "framework": spec.variant.framework,
        "stage": spec.variant.stage,
        "offload": spec.variant.offload,
        "size": spec.settings.size,
        "world_size": spec.world_size,
    }


def run(spec: RowSpec, out: Path) -> None:
    clock = Clock()
    torch.set_num_threads(spec.settings.threads)
    init_process_group(spec.variant.framework)
    clock.mark("init_process_group")
    rank = dist.get_rank()
    model = build_model(spec.settings)
    numel = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    clock.mark("build_model")
    try:
        trainer = build_trainer(spec, model)
    except NotImplementedRow as err:
        if rank == 0:
            write_json(out, _not_run(spec, "not implemented", str(err)))
        return
    clock.mark("wrap_model")
    mine = time_steps(trainer, spec, rank)
    clock.mark("steps")
    profile_steps = int(spec.extra.get("profile_steps", 0))
    phases = profile(trainer, spec, rank, profile_steps, out) if profile_steps else None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, asdict(mine))
    if rank == 0:
        row = summarize(spec, [RankResult(**r) for r in everyone], numel, trainable)
        row["optimizer"] = str((spec.extra.get("optimizer") or {}).get("type", "AdamW"))
        row["setup_s"] = clock.phases
        if phases is not None:
            row["profile"] = phases
        write_json(out, row)


class Clock:
    """Wall seconds of the phases of a row, from the launch (the driver's BENCH_LAUNCH_TIME)."""

    def __init__(self) -> None:
        launched = float(os.environ.get("BENCH_LAUNCH_TIME", time.time()))
        self.phases: dict[str, float] = {"launch_to_worker": time.time() - launched}
        self._last = time.time()

    def mark(self, name: str) -> None:
        now = time.time()
        self.phases[name] = now - self._last
        self._last = now


# Ranges and operators whose time the profile summary reports (names starting with "zeroshard." are added).
_PROFILED = (
    "bench.step",
    "aten::mm",
    "torch::autograd::AccumulateGrad",
    "aten::copy_",
    "aten::clone",
    "aten::add_",
    "aten::zero_",
    "aten::_fused_adamw_",
    "gloo:all_reduce",
    "gloo:all_gather",
    "gloo:reduce_scatter",
    "gloo:broadcast",  # the in-place all-gather's pieces ([Note: gloo in place])
    "gloo:reduce",  # the in-place reduce-scatter's pieces
    "gloo:barrier",
)


def profile(trainer: Trainer, spec: RowSpec, rank: int, steps: int, out: Path) -> dict[str, float]:
    """`steps` more steps under torch.profiler (after the timed ones, so no timing is disturbed).
    Rank 0 writes the operator table next to the row's JSON; returns ms per step by range/operator."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batches = Batches(spec.settings, spec.world_size)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for step in range(steps):
            x, y = batches.for_rank(spec.settings.steps + step, rank)
            dist.barrier()
            with torch.profiler.record_function("bench.step"):
                trainer.train_step(x, y)
    averages = prof.key_averages()
    if rank == 0:
        table = averages.table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=60)
        out.with_suffix(".profile.txt").write_text(str(table))
    return {
        e.key: e.cpu_time_total / steps / 1e3 for e in averages if e.key in _PROFILED or e.key.startswith("zeroshard.")
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, help="row spec JSON file (RowSpec.to_json)")
    parser.add_argument("--out", required=True, help="where rank 0 writes the row's result JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("ZEROSHARD_LOG_LEVEL", "WARNING")
    spec = RowSpec.from_json(Path(args.spec).read_text())
    try:
        run(spec, Path(args.out))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
