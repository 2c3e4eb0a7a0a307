"""One framework's checkpoint timings, run by torchrun (one process per rank).

    torchrun --standalone --nproc_per_node 2 -m benchmarks.checkpoint_worker \
        --framework zeroshard --size 120m --stage 2 --repeats 3 --root /tmp/ckpt --out row.json

Builds the model, takes one training step (so optimizer state exists), saves `repeats` checkpoints
into fresh directories, then drops that engine, builds a fresh one in the same processes and loads
each checkpoint into it. Times are wall seconds on rank 0 between barriers. After the loads, the
fresh engine's loss on the probe batch is compared with the trained engine's: a load that restored
nothing would show up there.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.models.gpt import GPT, PRESETS


def config(stage: int) -> dict[str, Any]:
    """The same ds_config for both frameworks: fp32, client AdamW, no clipping."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1_000_000,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
    }


def build_engine(framework: str, size: str, stage: int) -> tuple[Any, int]:
    """Same initial weights and a client `torch.optim.AdamW` (no DeepSpeed op build needed on CPU)."""
    torch.manual_seed(0)
    model = GPT(PRESETS[size])
    numel = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if framework == "deepspeed":
        import deepspeed

        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(stage))
    else:
        import zeroshard

        engine, _, _, _ = zeroshard.initialize(model=model, optimizer=optimizer, config=config(stage))
    return engine, numel


def probe_batch(size: str) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = PRESETS[size]
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.block_size + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def timed(op: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    op()
    dist.barrier()
    return time.perf_counter() - start


def disk_bytes(path: Path) -> tuple[int, int]:
    """(allocated bytes as `du` counts them, apparent bytes) of every file under `path`."""
    allocated = apparent = 0
    for root, _, files in os.walk(path):
        for name in files:
            st = os.stat(os.path.join(root, name))
            allocated += st.st_blocks * 512
            apparent += st.st_size
    return allocated, apparent


def loss_of(engine: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float(engine(*batch).detach())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--framework", choices=("zeroshard", "deepspeed"), required=True)
    parser.add_argument("--size", default="120m", choices=sorted(PRESETS))
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", required=True, help="checkpoint directories go under here")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    if args.framework == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    dirs = [Path(args.root) / f"{args.framework}-s{args.stage}-r{i}" for i in range(args.repeats)]
    batch = probe_batch(args.size)

    engine, numel = build_engine(args.framework, args.size, args.stage)
    loss = engine(*batch)
    engine.backward(loss)
    engine.step()
    trained_loss = loss_of(engine, batch)
    save_s = [timed(partial(engine.save_checkpoint, str(d))) for d in dirs]
    del engine
    gc.collect()

    fresh, _ = build_engine(args.framework, args.size, args.stage)
    fresh_loss = loss_of(fresh, batch)
    load_s = [timed(partial(fresh.load_checkpoint, str(d))) for d in dirs]
    loaded_loss = loss_of(fresh, batch)

    if rank == 0:
        allocated, apparent = disk_bytes(dirs[0])
        files = sorted(str(p.relative_to(dirs[0])) for p in dirs[0].rglob("*") if p.is_file())
        row = {
            "framework": args.framework,
            "size": args.size,
            "stage": args.stage,
            "world_size": dist.get_world_size(),
            "numel": numel,
            "save_s": save_s,
            "load_s": load_s,
            "disk_bytes": allocated,
            "apparent_bytes": apparent,
            "files": files,
            "trained_loss": trained_loss,
            "fresh_loss": fresh_loss,
            "loaded_loss": loaded_loss,
        }
        Path(args.out).write_text(json.dumps(row, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
