"""Ulysses sequence parallelism against data parallelism, zeroshard and DeepSpeed side by side, in one run.

    python -m benchmarks.ulysses                       # markdown table on stdout (~4 min here)
    python -m benchmarks.ulysses --seq 8192 --rows zeroshard-sp2,deepspeed-sp2

A 4-layer GPT (n_embd 256, 8 heads, fp32, AdamW, ZeRO-2, no gradient clipping) on 2 gloo ranks, sequences of `--seq`
tokens, micro-batch 1. `dp`: each rank trains one whole sequence, two per step (plain data parallelism). `sp2`: the
two ranks split one sequence (`DistributedAttention`, [Note: sequence parallelism]), one per step: each rank holds
the activations of half the sequence and attends over all of it for half of the heads, which is what lets a sequence
too long for one rank train. zeroshard reads `sequence_parallel_size`; DeepSpeed 0.19.8 gets its sequence-parallel
mpu (`parallel_state_sp`) and its own `DistributedAttention`. Per row: the median step time of the timed steps and
the global tokens/s (ratios against the first row, measured in this one run), each rank's peak resident memory
during the training steps as the OS counts it (VmHWM after the steps minus VmRSS before them, read from
/proc/self/status: the activations, gradients and optimizer state the steps add), and the bytes per rank per step of
the all-to-alls and of the gradient collectives, counted for both frameworks alike from torch's c10d operators
during the warm-up step ([Note: measuring communication] in benchmarks/workers/commcount.py). The first step's loss
is printed: the dp rows average two sequences, the sp2 rows' is the first of them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import describe
from benchmarks.resident_memory import proc_status

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.harness import run_on_ranks  # noqa: E402

MiB = 1 << 20
ROWS = ["zeroshard-dp", "zeroshard-sp2", "deepspeed-dp", "deepspeed-sp2"]
TIMED_STEPS = 3


def _config(framework: str, sp: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 2**24, "allgather_bucket_size": 2**24},
    }
    if framework == "deepspeed":
        config["zero_allow_untested_optimizer"] = True
    elif sp:
        config["sequence_parallel_size"] = 2
    return config


def _model(seq: int, framework: str, sp: bool) -> Any:
    import torch

    from helpers.ulysses import UlyssesGPT, UlyssesSelfAttention
    from zeroshard.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=seq, n_layer=4, n_head=8, n_embd=256, bias=False)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    if not sp:
        return gpt
    if framework == "deepspeed":
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.sequence.layer import DistributedAttention

        parallel_state_sp.initialize_sequence_parallel(2)
        group = parallel_state_sp.get_sequence_parallel_group()
    else:
        from zeroshard.sequence.layer import DistributedAttention

        group = None  # the engine's
    for block in gpt.blocks:
        state = block.attn.state_dict()
        block.attn = UlyssesSelfAttention(cfg, group, DistributedAttention)
        block.attn.load_state_dict(state)
    return UlyssesGPT(gpt)


def measure(rank: int, world_size: int, row: str, seq: int) -> dict[str, Any]:
    import torch

    from benchmarks.workers.commcount import CommCounter

    torch.set_num_threads(1)
    framework, mode = row.split("-")
    sp = mode == "sp2"
    if framework == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # before its mpu makes groups
    model = _model(seq, framework, sp)
    if framework == "deepspeed":
        mpu = None
        if sp:
            from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_config(framework, sp), mpu=mpu
        )
    else:
        import zeroshard

        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=_config(framework, sp)
        )
    gen = torch.Generator().manual_seed(1)
    steps = [torch.randint(0, 512, (2, seq + 1), generator=gen) for _ in range(1 + TIMED_STEPS)]

    def step(tokens: torch.Tensor) -> float:
        x, y = tokens[:, :-1], tokens[:, 1:]
        if sp:  # the first sequence, this rank's half of it
            half = slice(rank * seq // 2, (rank + 1) * seq // 2)
            loss = engine(x[:1, half], y[:1, half], rank * seq // 2, seq)
        else:  # this rank's whole sequence
            loss = engine(x[rank : rank + 1], y[rank : rank + 1])
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    before = proc_status("VmRSS")
    counter = CommCounter(world_size)
    with counter:
        first_loss = step(steps[0])
    times = []
    for tokens in steps[1:]:
        start = time.perf_counter()
        step(tokens)
        times.append(time.perf_counter() - start)
    return {
        "loss": first_loss,
        "step_s": statistics.median(times),
        "grown": proc_status("VmHWM") - before,
        "all_to_all": counter.bus_bytes.get("all_to_all", 0.0),
        "gradients": sum(v for k, v in counter.bus_bytes.items() if k != "all_to_all"),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ulysses", description=__doc__)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--seq", type=int, default=4096)
    args = p.parse_args(argv)
    machine = describe()
    print(f"{machine['cpu']}, torch {machine['torch']}, deepspeed {machine.get('deepspeed', '-')}, {machine['date']}")
    print(f"2 ranks, sequences of {args.seq} tokens: dp trains 2 per step, sp2 one\n")
    print(
        "| row | step s (median) | tokens/s | tokens/s vs the first row | peak RSS growth MiB/rank (max) "
        "| all-to-all MB/rank/step | gradient collectives MB/rank/step | first loss (sum of ranks' parts) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    base = None
    for row in args.rows.split(","):
        ranks = run_on_ranks(measure, 2, row, args.seq, timeout=1800)
        step_s = max(r["step_s"] for r in ranks)
        sp = row.endswith("sp2")
        tokens_per_s = (1 if sp else 2) * args.seq / step_s
        base = base if base is not None else tokens_per_s
        loss = sum(r["loss"] for r in ranks) if sp else sum(r["loss"] for r in ranks) / 2
        print(
            f"| {row} | {step_s:.2f} | {(1 if sp else 2) * args.seq / step_s:.0f} | {tokens_per_s / base:.2f}x "
            f"| {max(r['grown'] for r in ranks) / MiB:.0f} | {ranks[0]['all_to_all'] / 1e6:.1f} "
            f"| {ranks[0]['gradients'] / 1e6:.1f} | {loss:.6f} |"
        )


if __name__ == "__main__":
    main()
