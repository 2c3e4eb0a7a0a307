"""Tiled compute ([Note: tiled compute]): a long-sequence step with and without tiling, zeroshard and DeepSpeed side
by side, in one run.

    python -m benchmarks.tiled                  # markdown table on stdout (~5 min here)
    python -m benchmarks.tiled --seq 4096 --rows zeroshard-untiled,zeroshard-tiled

A 2-layer GPT (n_embd 256, 8 heads, a 32000-token vocabulary as a Llama's, lm_head not tied to the embedding (with a
tied one DeepSpeed's ZeRO-2 stops at the second gradient of the shared weight), fp32, AdamW, ZeRO-2, no clipping) on
2 gloo ranks, one sequence of `--seq` tokens per rank and step. At long sequences the logits dominate a step's
memory: [seq, vocabulary] fp32, their gradient, and cross-entropy's log-softmax, each 1 GiB at 8192 tokens. `tiled`:
each MLP through `TiledMLP` (4 slices) and the loss through `TiledFusedLogitsLoss` (`--loss-shards` slices), so one
slice's logits exist at a time. zeroshard's rows use zeroshard's helpers and engine, DeepSpeed's rows DeepSpeed
0.19.8's helpers and engine (its helpers' loss runs the slices' backward inside forward, ours recomputes them in
backward: one more lm_head forward). Per row: the median step time of the timed steps and the tokens/s (ratios
against the first row, measured in this one run), each rank's peak resident memory during the steps as the OS counts
it (VmHWM after the steps minus VmRSS before them, /proc/self/status), and the first step's loss (the same for every
row: tiling changes the order of sums only).
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
ROWS = ["zeroshard-untiled", "zeroshard-tiled", "deepspeed-untiled", "deepspeed-tiled"]
TIMED_STEPS = 2
VOCAB = 32000


def _engine(framework: str, model: Any) -> Any:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 2**24, "allgather_bucket_size": 2**24},
    }
    if framework == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    import zeroshard

    return zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)[0]


def measure(rank: int, world_size: int, row: str, seq: int, loss_shards: int) -> dict[str, Any]:
    import importlib

    import torch

    from helpers.tiled import tile
    from zeroshard.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    framework, mode = row.split("-")
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=2, n_head=8, n_embd=256, bias=False))
    # untied, as a Llama-8B's: DeepSpeed's ZeRO-2 fails on a tied one under its tiled loss (a second gradient)
    gpt.lm_head.weight = torch.nn.Parameter(gpt.wte.weight.detach().clone())
    api = importlib.import_module(f"{framework}.runtime.sequence_parallel.ulysses_sp")
    tiled = mode == "tiled"
    model = tile(gpt, "listed" if tiled else "off", "fused" if tiled else "plain", api, 4, loss_shards)
    engine = _engine(framework, model)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (world_size, seq + 1), generator=gen) for _ in range(1 + TIMED_STEPS)]

    def step(tokens: torch.Tensor) -> float:
        x, y = tokens[rank : rank + 1, :-1], tokens[rank : rank + 1, 1:]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    before = proc_status("VmRSS")
    first_loss = step(batches[0])
    times = []
    for tokens in batches[1:]:
        start = time.perf_counter()
        step(tokens)
        times.append(time.perf_counter() - start)
    return {"loss": first_loss, "step_s": statistics.median(times), "grown": proc_status("VmHWM") - before}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tiled", description=__doc__)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--loss-shards", type=int, default=8)
    args = p.parse_args(argv)
    machine = describe()
    print(f"{machine['cpu']}, torch {machine['torch']}, deepspeed {machine.get('deepspeed', '-')}, {machine['date']}")
    print(f"2 ranks, one sequence of {args.seq} tokens each per step, vocabulary {VOCAB}\n")
    print(
        "| row | step s (median) | tokens/s | tokens/s vs the first row | peak RSS growth MiB/rank (max) | first loss |"
    )
    print("|---|---:|---:|---:|---:|---|")
    base = None
    for row in args.rows.split(","):
        ranks = run_on_ranks(measure, 2, row, args.seq, args.loss_shards, timeout=1800)
        step_s = max(r["step_s"] for r in ranks)
        tokens_per_s = 2 * args.seq / step_s
        base = base if base is not None else tokens_per_s
        print(
            f"| {row} | {step_s:.2f} | {tokens_per_s:.0f} | {tokens_per_s / base:.2f}x "
            f"| {max(r['grown'] for r in ranks) / MiB:.0f} | {sum(r['loss'] for r in ranks) / 2:.6f} |"
        )


if __name__ == "__main__":
    main()
