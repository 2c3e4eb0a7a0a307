"""Collective bandwidth through zeroshard's `Collectives` on gloo, by message size (run by torchrun).

    torchrun --standalone --nproc_per_node 2 -m benchmarks.workers.collectives --out coll.json

S is the full message (the all-gather output, the reduce-scatter input). Bus bandwidth is
S·(N-1)/N / time, the bytes each rank sends in the ring model (`CommStats`), as nccl-tests reports it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks.bandwidth import stream_bandwidth
from benchmarks.workers.common import write_json
from zeroshard.comm.collectives import Collectives


def _time(op: Callable[[], object], min_time: float = 0.2, max_iters: int = 20) -> float:
    """Best seconds of `op` over enough iterations (after one warm-up); every rank runs the same count."""
    op()
    times: list[float] = []
    while True:  # the decision to stop is all-reduced, so every rank leaves after the same iteration
        dist.barrier()
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
        done = torch.tensor([float(len(times) >= 3 and (sum(times) >= min_time or len(times) >= max_iters))])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() > 0:
            return min(times)


def measure(comm: Collectives, sizes: list[int]) -> list[dict[str, float]]:
    n = comm.world_size
    rows = []
    for nbytes in sizes:
        full = torch.ones(nbytes // 4 // n * n, dtype=torch.float32)
        part = torch.ones(full.numel() // n, dtype=torch.float32)
        s = full.numel() * 4
        gather = _time(lambda: comm.all_gather(full, part))  # noqa: B023 - called within this iteration
        scatter = _time(lambda: comm.reduce_scatter(part, full))  # noqa: B023
        ring = s * (n - 1) / n
        rows.append(
            {
                "bytes": s,
                "all_gather_s": gather,
                "reduce_scatter_s": scatter,
                "all_gather_busbw": ring / gather,
                "reduce_scatter_busbw": ring / scatter,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-bytes", type=int, default=64 * 2**20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    comm = Collectives(None, n, rank)
    alone = stream_bandwidth() if rank == 0 else 0.0  # one rank streaming, the others waiting
    dist.barrier()
    together = torch.tensor([stream_bandwidth()])  # all ranks at once, as during a collective
    dist.all_reduce(together)
    sizes = []
    size = 64 * 2**10
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 2
    rows = measure(comm, sizes)
    if rank == 0:
        write_json(
            args.out,
            {"world_size": n, "mem_bw_one_rank": alone, "mem_bw_all_ranks": float(together.item()), "sizes": rows},
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
