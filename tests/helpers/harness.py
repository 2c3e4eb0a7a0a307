"""Run a test body on N gloo ranks inside pytest.

`run_on_ranks(fn, world_size, *args)` spawns `world_size` processes that join one gloo group and call
`fn(rank, world_size, *args)`; it returns the list of per-rank results. A rank that raises fails the
test with that rank's traceback; a rank that hangs fails it after `timeout` seconds. Put many cases
in one `fn` to pay the start-up once.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        ZEROSHARD_LOG_LEVEL="WARNING",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # by value: torch's queue would pass tensors as shared-memory fds that die with this process
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while len(collected) + len(errors) < world_size:
            try:
                rank, status, payload = results.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish within {timeout}s"
                ) from None
            if status == "ok":
                collected[rank] = pickle.loads(payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.terminate()
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    return [collected[r] for r in range(world_size)]
