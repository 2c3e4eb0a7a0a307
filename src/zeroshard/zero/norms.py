"""Which parameters the flat tensors of stages 0-2 hold pieces of, for LAMB's per-parameter norms ([Note: LAMB on flat
shards] in optim/lamb.py).

A flat master of stages 1-2 holds, on each rank, pieces of the parameters of one optimizer group (zero/layout.py):
slot i of the group's layout is parameter i, and `owned_pieces` says where each piece lies in this rank's shard. The
partial sums are added over the data-parallel group. At stage 0 every rank holds every parameter whole: nothing is
added (every rank computes the whole norms itself).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.zero.layout import GroupLayout, owned_pieces


class FlatNormPlan:
    """Stages 0-2: one flat master per optimizer group. The strategy steps the groups in the same order on every rank,
    so a group whose master is being stepped is being stepped everywhere."""

    def __init__(
        self,
        groups: dict[int, tuple[torch.Tensor, GroupLayout]],
        shard_count: int,
        comm: Collectives,
        device: torch.device,
    ):
        self.comm = comm if shard_count > 1 else None
        self.device = device  # where the all-reduce runs (NCCL reduces device memory only; host masters sum on the CPU)
        self.masters: dict[int, tuple[torch.Tensor, int, list[tuple[int, int, int]]]] = {}
        for g, (master, layout) in groups.items():
            rank = comm.rank if shard_count > 1 else 0
            pieces = [(p.shard_offset, p.param_end - p.param_begin, p.slot) for p in owned_pieces(layout, rank)]
            self.masters[g] = (master, len(layout.slots), pieces)

    def segments(
        self, group: int, stepped: Sequence[torch.Tensor]
    ) -> tuple[int, dict[int, list[tuple[int, int, int]]]]:
        master, count, pieces = self.masters[group]
        if not any(t is master for t in stepped):
            return 0, {}
        return count, {id(master): pieces}

    def reduce(self, sums: torch.Tensor) -> None:
        if self.comm is not None:
            reduce_on(self.comm, self.device, sums)


def reduce_on(comm: Collectives, device: torch.device, sums: torch.Tensor) -> None:
    """`sums` summed over `comm`'s ranks, through `device` (a rank's sums may be on the host: offloaded masters, or
    none of a group's pieces on this rank), in place."""
    on_device = sums.to(device)
    comm.all_reduce(on_device, label="lamb: parameter norms")
    sums.copy_(on_device)


class ShardNormPlan:
    """The fsdp2 backend: each master is this rank's rows of one parameter (FSDP2's Shard(0)), the group's parameters
    in the same order on every rank; every rank steps every group at once."""

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]], comm: Collectives, device: torch.device):
        self.groups = [list(members) for members in groups]
        self.comm = comm if comm.world_size > 1 else None
        self.device = device

    def segments(
        self, group: int, stepped: Sequence[torch.Tensor]
    ) -> tuple[int, dict[int, list[tuple[int, int, int]]]]:
        members = self.groups[group]
        return len(members), {id(t): [(0, t.numel(), k)] for k, t in enumerate(members)}

    def reduce(self, sums: torch.Tensor) -> None:
        if self.comm is not None:
            reduce_on(self.comm, self.device, sums)
