"""bf16 LoRA at ZeRO-3: what the frozen base costs per rank, zeroshard against DeepSpeed, as the OS counts it.

    python -m benchmarks.lora_bf16                  # markdown table on stdout (~3 min here)
    python -m benchmarks.lora_bf16 --frameworks zeroshard,zeroshard-int8

The 120m GPT with peft's LoRA adapters (rank 16) on every block's linear layers and everything else frozen
(`benchmarks.workers.common.build_model`), bf16, AdamW over the adapters, `stage3_param_persistence_threshold` 0
(the adapters stay in their blocks' units, as at 7B+ sizes), 2 gloo ranks, 2 steps of 8 tokens (bf16 matmuls are
slow on this CPU; the model states do not depend on the tokens). Each rank reports its VmRSS after the steps minus
its VmRSS before building the model (from /proc/self/status: what the model and the engine hold, as the OS counts
it; the fp32 model each rank builds first is freed once sharded), its master-weight bytes and its losses. A frozen
parameter should cost its bf16 shard only, 2/N bytes ([Note: frozen parameters at stage 3] in
src/zeroshard/zero/stage3/unit.py); `zeroshard-int8` adds `zero_quantized_nontrainable_weights`, which holds it as
int8 blocks, about 1/N byte ([Note: quantized frozen weights] in src/zeroshard/zero/stage3/packed.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.machine import describe
from benchmarks.resident_memory import proc_status

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.harness import run_on_ranks  # noqa: E402

MiB = 1 << 20
STEPS = 2


def _config(framework: str = "zeroshard") -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "zero_quantized_nontrainable_weights": framework == "zeroshard-int8",
        },
    }


def measure(rank: int, world_size: int, framework: str) -> dict[str, Any]:
    import torch

    from benchmarks.spec import TrainSettings
    from benchmarks.workers.common import Batches, build_model, train_steps

    torch.set_num_threads(1)
    settings = TrainSettings(size="120m", lora_rank=16, seq_len=8)
    before = proc_status("VmRSS")
    model = build_model(settings)
    trainable = [p for p in model.parameters() if p.requires_grad]
    numel, adapters = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in trainable)
    if framework == "deepspeed":
        import deepspeed

        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=_config())
    else:
        import zeroshard

        config = _config(framework)
        engine, optimizer, _, _ = zeroshard.initialize(model=model, model_parameters=trainable, config=config)
    del model
    losses = train_steps(engine, Batches(settings, world_size), rank, STEPS)
    if framework == "deepspeed":
        flat = getattr(optimizer, "fp32_partitioned_groups_flat", [])
        master = sum(t.numel() * t.element_size() for t in flat)
        shards = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters())
    else:
        master = engine.memory_report().master_weights
        shards = engine.memory_report().params
    return {
        "shards": shards,
        "numel": numel,
        "adapters": adapters,
        "grown": proc_status("VmRSS") - before,
        "master": master,
        "losses": losses,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora_bf16", description=__doc__)
    p.add_argument("--frameworks", default="zeroshard,zeroshard-int8,deepspeed")
    args = p.parse_args(argv)
    machine = describe()
    print(f"{machine['cpu']}, torch {machine['torch']}, deepspeed {machine.get('deepspeed', '-')}, {machine['date']}\n")
    print(
        "| framework | parameters (adapters) | RSS growth MiB/rank (max) | parameter shards MiB/rank (max) "
        "| fp32 masters MiB/rank | losses (rank 0) |"
    )
    print("|---|---|---:|---:|---:|---|")
    for framework in args.frameworks.split(","):
        ranks = run_on_ranks(measure, 2, framework, timeout=900)
        first = ranks[0]
        print(
            f"| {framework} | {first['numel'] / 1e6:.1f}M ({first['adapters'] / 1e6:.2f}M) "
            f"| {max(r['grown'] for r in ranks) / MiB:.0f} | {max(r['shards'] for r in ranks) / MiB:.1f} "
            f"| {max(r['master'] for r in ranks) / MiB:.1f} "
            f"| {', '.join(f'{v:.6f}' for v in first['losses'])} |"
        )


if __name__ == "__main__":
    main()
