"""A tiny training run for the cluster launch tests: `python cluster_train.py OUT CONFIG STEPS [SLEEP_S]`.

Each optimizer step sees global samples [8 * step, 8 * step + 8), split evenly over the ranks, so any
world size with the same global batch trains the same model. Rank 0 appends "step loss" lines to
OUT/losses.txt (the global mean loss of the step); with "checkpoint" in OUT the run saves every step to
OUT/ckpt and resumes from `latest` first, so a restarted or resized job continues where it stopped.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import zeroshard

GLOBAL_BATCH = 8


def samples(start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 8, generator=gen)[start : start + count]
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    argv = sys.argv[1:]
    if "LOCAL_RANK" in os.environ:  # launched: zeroshard launch's --local_rank=N first, as DeepSpeed's launcher's
        given = argv.pop(0)
        assert given == f"--local_rank={os.environ['LOCAL_RANK']}", given
    out, config_path, steps = argv[0], argv[1], int(argv[2])
    sleep_s = float(argv[3]) if len(argv) > 3 else 0.0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.train_batch_size() == GLOBAL_BATCH
    ckpt = os.path.join(out, "ckpt")
    if os.path.isdir(ckpt):
        engine.load_checkpoint(ckpt)
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    while engine.global_steps < steps:
        step, total = engine.global_steps, torch.zeros(1)
        for j in range(accum):
            x, y = samples(step * GLOBAL_BATCH + rank * micro * accum + j * micro, micro)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        engine.save_checkpoint(ckpt)
        if rank == 0:
            with open(os.path.join(out, "losses.txt"), "a", encoding="utf-8") as handle:
                handle.write(f"{step} {total.item() / (world * accum):.7f} {world}\n")
        time.sleep(sleep_s)
    engine.destroy()


if __name__ == "__main__":
    main()
