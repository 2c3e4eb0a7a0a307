"""Ranks that took different code paths: named in an error instead of a hang.

[Note: divergence check]
Stage 3 issues many collectives from hooks, where ranks that ran different modules would otherwise hang or
abort in the backend. Three layers catch it: on gloo a fingerprint exchange before each collective (`Collectives`
with `verify=True`); a wait that times out asks every rank, through the rendezvous store, what it is waiting on
(`DivergenceWatch.wait`); and once per step a digest of the units each rank gathered is compared (`check_step`),
which catches what equal-sized units would hide when collectives are not fingerprinted (NCCL, where a per-
collective check would sync the host with the GPU).
"""

from __future__ import annotations

import datetime
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from zeroshard.comm.collectives import Collectives, Handle
from zeroshard.errors import CollectiveMismatchError


class DivergenceWatch:
    """Waits on collectives with a timeout on CPU and keeps the log of gathers the per-step digest covers."""

    def __init__(self, comm: Collectives, device: torch.device, timeout_s: float, name_of: Callable[[int], str]):
        self.comm = comm
        self.device = device
        self.timeout_s = timeout_s
        self._name_of = name_of  # unit index -> name, for the message
        self.gather_log: list[int] = []

    def wait(self, handle: Handle | None, what: str) -> None:
        """Wait for `handle`; on gloo, a wait longer than the timeout becomes a `CollectiveMismatchError`."""
        if handle is None:
            return
        if self.comm.world_size == 1 or self.device.type != "cpu":
            handle.wait()  # NCCL: a stream wait; a CPU timeout here would block the host on the GPU
            return
        try:
            handle.wait(datetime.timedelta(seconds=self.timeout_s))  # type: ignore[call-arg]
        except RuntimeError as err:
            if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                raise
            raise CollectiveMismatchError(self._diagnose(what)) from err

    def _diagnose(self, what: str) -> str:
        store = dist.distributed_c10d._get_default_store()
        rank, world_size = self.comm.rank, self.comm.world_size
        recent = [self._name_of(i) for i in self.gather_log[-3:]]
        store.set(f"zeroshard/diag/{rank}", f"waiting on {what}; last gathered units {recent}")
        lines = []
        for other in range(world_size):
            try:
                store.wait([f"zeroshard/diag/{other}"], datetime.timedelta(seconds=5))
                lines.append(f"rank {other}: {store.get(f'zeroshard/diag/{other}').decode()}")
            except RuntimeError:
                lines.append(f"rank {other}: did not answer (busy elsewhere or hung)")
        return (
            f"ranks diverged: rank {rank} waited {self.timeout_s:.0f}s on {what}, which not "
            "every rank issued. " + "; ".join(lines) + ". Every rank must run the same modules in the same order "
            "(a module skipped or added on some ranks only)."
        )

    def check_step(self) -> None:
        """Once per step: every rank gathered the same units in the same order. Redundant when every collective
        is fingerprinted."""
        world_size = self.comm.world_size
        if world_size == 1 or self.comm.verify:
            self.gather_log.clear()
            return
        digest = zlib.crc32(bytes(str(self.gather_log), "ascii"))
        mine = torch.tensor([digest, len(self.gather_log)], dtype=torch.int64, device=self.device)
        everyone = torch.zeros(2 * world_size, dtype=torch.int64, device=self.device)
        self.comm.all_gather(everyone, mine)
        rows = everyone.view(world_size, 2).tolist()
        self.gather_log.clear()
        if any(row != rows[0] for row in rows):
            raise CollectiveMismatchError(
                "ranks gathered different units in this step "
                + "; ".join(f"rank {r}: {n} gathers (digest {d})" for r, (d, n) in enumerate(rows))
                + ". Every rank must run the same modules in the same order."
            )
