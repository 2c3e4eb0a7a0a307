"""Entry point of one benchmark row, run by torchrun on every rank:

    torchrun --standalone --nproc_per_node 2 -m benchmarks.workers.main --spec row.json --out result.json

Rank 0 writes the row's JSON (`status` "ok", or "not implemented" / "skipped" with a `note`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.spec import RowSpec
from benchmarks.workers.common import (
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
    return {"status": status, "note": note, "row_id": spec.row_id, "variant": spec.variant.key,
            "label": spec.variant.label, "framework": spec.variant.framework, "stage": spec.variant.stage,
            "offload": spec.variant.offload, "size": spec.settings.size, "world_size": spec.world_size}


def run(spec: RowSpec, out: Path) -> None:
    torch.set_num_threads(spec.settings.threads)
    init_process_group(spec.variant.framework)
    rank = dist.get_rank()
    model = build_model(spec.settings)
    numel = sum(p.numel() for p in model.parameters())
    try:
        trainer = build_trainer(spec, model)
    except NotImplementedRow as err:
        if rank == 0:
            write_json(out, _not_run(spec, "not implemented", str(err)))
        return
    mine = time_steps(trainer, spec, rank)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, asdict(mine))
    if rank == 0:
        write_json(out, summarize(spec, [RankResult(**r) for r in everyone], numel))


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
