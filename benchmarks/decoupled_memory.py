"""Peak resident memory of a save, synchronous next to decoupled (`checkpoint.writer.decoupled`), from /proc.

    python -m benchmarks.decoupled_memory sync /tmp/ckpt_sync
    python -m benchmarks.decoupled_memory decoupled /tmp/ckpt_decoupled

One process (world size 1), `GPT(PRESETS["120m"])` fp32 at stage 3 with a client AdamW, two steps; then VmHWM is
reset (`/proc/self/clear_refs` 5) and a save, one more step and the commit run: the peak over them, against VmRSS
before the save. The decoupled writer reads views of the shards, so its peak should be the synchronous one's.
"""

from __future__ import annotations

import sys

import torch

import zeroshard
from benchmarks.machine import status_mib
from zeroshard.models.gpt import GPT, PRESETS


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = GPT(PRESETS["120m"])
    cfg: dict = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    cfg["zero_allow_untested_optimizer"] = True
    if mode == "decoupled":
        cfg["checkpoint"] = {"writer": {"decoupled": True}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=cfg)
    tokens = torch.randint(0, 1000, (1, 65), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.step()

    step()
    step()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = status_mib("VmRSS")
    engine.save_checkpoint(root)
    step()
    engine.commit_checkpoint()
    peak = status_mib("VmHWM")
    print(f"{mode}: VmRSS before the save {before} MiB, VmHWM over save + step + commit {peak} MiB (+{peak - before})")  # noqa: T201


if __name__ == "__main__":
    main()
