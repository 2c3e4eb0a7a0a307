"""bf16 master weights at ZeRO-3: model-state bytes per rank by master and optimizer-state dtype, as the OS counts
them, zeroshard against DeepSpeed 0.19.8 with the same keys.

    python -m benchmarks.bf16_master                  # markdown table on stdout (~4 min here)
    python -m benchmarks.bf16_master --frameworks zeroshard

The 120m GPT, every parameter trained, bf16, AdamW, ZeRO-3 with `stage3_param_persistence_threshold` 0, 2 gloo
ranks, 2 steps of 8 tokens (bf16 matmuls are slow on this CPU; the model states do not depend on the tokens), in
three modes: mixed precision (fp32 masters and Adam state, DeepSpeed's default), `bf16_master_weights_and_grads`
(fp32 state: zeroshard only, DeepSpeed allows it only with offload_optimizer and its CPU Adam), and both keys (bf16
masters and state). Each rank reports its VmRSS after the steps minus its VmRSS before building the model and its
VmHWM (peak, including the fp32 model each rank builds first and frees once sharded), both from /proc/self/status,
the engine's model-state bytes (zeroshard's `memory_report`; DeepSpeed's from its partitions and optimizer state)
and its losses. Expected model states per rank: 16, 12 and 8 bytes per parameter / 2 ([Note: bf16 master weights]
in src/zeroshard/optim/state_dtype.py).
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
MODES = {  # name: (bf16_master_weights_and_grads, bf16_optimizer_states)
    "mixed": (False, False),
    "bf16 masters": (True, False),
    "bf16 masters + state": (True, True),
}


def _config(mode: str) -> dict[str, Any]:
    master, state = MODES[mode]
    bf16: dict[str, Any] = {"enabled": True}
    if master:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=state)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": bf16,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def measure(rank: int, world_size: int, framework: str, mode: str) -> dict[str, Any]:
    import torch

    from benchmarks.spec import TrainSettings
    from benchmarks.workers.common import Batches, build_model, tensor_bytes, train_steps

    torch.set_num_threads(1)
    settings = TrainSettings(size="120m", seq_len=8)
    before = proc_status("VmRSS")
    model = build_model(settings)
    numel = sum(p.numel() for p in model.parameters())
    if framework == "deepspeed":
        import deepspeed

        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_config(mode)
        )
    else:
        import zeroshard

        engine, optimizer, _, _ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=_config(mode)
        )
    del model
    losses = train_steps(engine, Batches(settings, world_size), rank, STEPS)
    if framework == "deepspeed":
        params = tensor_bytes(getattr(optimizer, "fp16_partitioned_groups_flat", []))
        flat = getattr(optimizer, "fp32_partitioned_groups_flat", [])
        aliased = {t.data_ptr() for t in getattr(optimizer, "fp16_partitioned_groups_flat", [])}
        masters = tensor_bytes(t for t in flat if t.data_ptr() not in aliased)
        inner = getattr(optimizer, "optimizer", optimizer)
        state = tensor_bytes(v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
        states = params + masters + state
    else:
        report = engine.memory_report()
        states = report.params + report.master_weights + report.optimizer_state
    grown, peak = proc_status("VmRSS") - before, proc_status("VmHWM")
    return {"numel": numel, "grown": grown, "peak": peak, "states": states, "losses": losses}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bf16_master", description=__doc__)
    p.add_argument("--frameworks", default="zeroshard,deepspeed")
    args = p.parse_args(argv)
    machine = describe()
    print(f"{machine['cpu']}, torch {machine['torch']}, deepspeed {machine.get('deepspeed', '-')}, {machine['date']}\n")
    print(
        "| framework | mode | parameters | model states MiB/rank (bytes/param/rank) | RSS growth MiB/rank (max) "
        "| peak RSS (VmHWM) MiB/rank (max) | losses (rank 0) |"
    )
    print("|---|---|---|---:|---:|---:|---|")
    for framework in args.frameworks.split(","):
        for mode in MODES:
            if framework == "deepspeed" and mode == "bf16 masters":
                continue  # DeepSpeed asserts offload_optimizer and DeepSpeedCPUAdam for fp32 state with bf16 masters
            ranks = run_on_ranks(measure, 2, framework, mode, timeout=900)
            first = ranks[0]
            states = max(r["states"] for r in ranks)
            print(
                f"| {framework} | {mode} | {first['numel'] / 1e6:.1f}M | {states / MiB:.0f} "
                f"({states / first['numel']:.1f}) | {max(r['grown'] for r in ranks) / MiB:.0f} "
                f"| {max(r['peak'] for r in ranks) / MiB:.0f} "
                f"| {', '.join(f'{v:.6f}' for v in first['losses'])} |"
            )


if __name__ == "__main__":
    main()
