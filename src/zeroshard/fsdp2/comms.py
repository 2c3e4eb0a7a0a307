"""FSDP2's all-gathers and reduce-scatters, counted in the engine's `comm_stats` like the zero backend's.

FSDP2 calls torch.distributed itself; its `set_custom_all_gather`/`set_custom_reduce_scatter` hooks let the same
collectives be issued through these wrappers, which add each one's bytes to `Collectives.stats` (payload, and the
ring's bus bytes) and otherwise do exactly what FSDP2's defaults do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from zeroshard.comm.collectives import (
    CollectiveKind,
    Collectives,
    CommStats,
    Scope,
    all_gather_single,
    gather_in_place,
    reduce_scatter_single,
)
from zeroshard.offload.host_memory import fresh_empty


def _record(stats: CommStats, kind: CollectiveKind, tensor: torch.Tensor, world_size: int, scope: Scope) -> None:
    nbytes = tensor.numel() * tensor.element_size()
    stats.record(kind, nbytes, nbytes * (world_size - 1) / world_size, scope)


class _Counted:
    """What both wrappers share: the engine's collectives (their counters, scope and in-flight tensors)."""

    def __init__(self, comm: Collectives):
        self.comm = comm  # [Note: scopes]: comm.scope is where the group FSDP2 communicates over sits

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2's whole-unit buffers (the all-gather's output, the reduce-scatter's input), fresh every step: on the
        CPU under the fixed mmap threshold, advised to huge pages ([Note: huge pages for fresh host buffers])."""
        return fresh_empty(math.prod(int(n) for n in size), dtype, device).view(*size)


class CountedAllGather(_Counted, AllGather):
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        comm = self.comm
        _record(comm.stats, CollectiveKind.ALL_GATHER, output_tensor, comm.world_size, comm.scope)
        if output_tensor.device.type == "cpu" and dist.get_backend(group) == "gloo":  # [Note: gloo in place]
            rank = dist.get_rank(group)
            return gather_in_place(  # type: ignore[no-any-return]
                output_tensor, input_tensor, group, rank, comm.world_size, async_op, comm.in_flight
            )
        return comm.in_flight.issue(  # type: ignore[no-any-return]  # [Note: nothing held by a collective at exit]
            (input_tensor, output_tensor),
            lambda: all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op),
        )


class CountedReduceScatter(_Counted, ReduceScatter):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        comm = self.comm
        _record(comm.stats, CollectiveKind.REDUCE_SCATTER, input_tensor, comm.world_size, comm.scope)
        return comm.in_flight.issue(  # type: ignore[no-any-return]  # [Note: nothing held by a collective at exit]
            (input_tensor, output_tensor),
            lambda: reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op),
        )
