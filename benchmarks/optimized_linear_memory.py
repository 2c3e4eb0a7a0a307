"""Resident memory of `deepspeed.linear`'s LoRA layers with sharded base weights: DeepSpeed 0.19.8's next to
zeroshard's, from /proc, on 2 gloo ranks.

    python -m benchmarks.optimized_linear_memory          # the table (each row: torchrun, 2 ranks)

A stack of LAYERS `LoRAOptimizedLinear(HIDDEN, HIDDEN)` layers in fp32 (rank 16), built with `base_weight_sharding`
1 (whole base weights on every rank) or 2 (half each); TOKENS rows of input through all of them, then backward.
Each rank runs with `MALLOC_MMAP_THRESHOLD_=65536` (freed buffers go back to the OS); after the layers are built
VmHWM is reset (`/proc/self/clear_refs` 5). Reported, the larger of the two ranks: the base weights a rank keeps,
what the forward leaves held (VmRSS after it minus before: what autograd saved for backward), the peak over
forward and backward (VmHWM minus before), and the step's time (forward+backward, median of 3 after one warm-up,
as a ratio to DeepSpeed's with the same sharding). DeepSpeed's forward hands each gathered whole weight to
`F.linear`, whose autograd keeps it until backward; zeroshard's gathers again in backward and keeps the shard only
([Note: frozen weights rebuilt in backward] in linear/frozen.py).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.machine import status_mib

LAYERS, HIDDEN, TOKENS = 8, 2048, 512


def _forward(layers: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def one(library: str, shards: int) -> None:
    import torch.distributed as dist

    if library == "deepspeed":
        import deepspeed as lib
        from deepspeed.linear import LoRAConfig, OptimizedLinear
    else:
        import zeroshard as lib
        from zeroshard.linear import LoRAConfig, OptimizedLinear
    lib.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    config = LoRAConfig(lora_r=16, lora_alpha=16, base_weight_sharding=shards)
    layers = [OptimizedLinear(HIDDEN, HIDDEN, lora_config=config, dtype=torch.float32) for _ in range(LAYERS)]
    kept = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers) >> 20
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(7), requires_grad=True)
    before = status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    y = _forward(layers, x)
    held = status_mib("VmRSS") - before
    y.square().mean().backward()
    peak = status_mib("VmHWM") - before
    times = []
    for _ in range(4):
        dist.barrier()
        start = time.perf_counter()
        y = _forward(layers, x)
        y.square().mean().backward()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    numbers = torch.tensor([held, peak, seconds * 1000.0])
    dist.all_reduce(numbers, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"ROW {library} {shards} {kept} {int(numbers[0])} {int(numbers[1])} {numbers[2].item():.1f}")
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        one(sys.argv[2], int(sys.argv[3]))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    rows = {}
    for shards in (1, 2):
        for library in ("deepspeed", "zeroshard"):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                   "benchmarks.optimized_linear_memory", "one", library, str(shards)]  # fmt: skip
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            line = next(x for x in out.splitlines() if x.startswith("ROW "))
            rows[library, shards] = line.split()[3:]
    print(f"{LAYERS} LoRAOptimizedLinear({HIDDEN}, {HIDDEN}) layers, fp32, rank 16, {TOKENS} tokens, 2 gloo ranks")
    print("| library | base_weight_sharding | base weights kept MiB | held after forward MiB | peak above start MiB "
          "| step ms | step time vs DeepSpeed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for (library, shards), (kept, held, peak, ms) in rows.items():
        ratio = float(ms) / float(rows["deepspeed", shards][3])
        print(f"| {library} | {shards} | {kept} | {held} | {peak} | {ms} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
