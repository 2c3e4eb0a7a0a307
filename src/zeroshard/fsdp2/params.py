"""One FSDP2-sharded parameter as zeroshard sees it: its name, its rows, the local tensor the optimizer steps.

[Note: fsdp2 shards are element ranges]
FSDP2 shards every parameter on dim 0 (`Shard(0)`) the way `torch.chunk` splits it: rank r holds rows
[r * c, r * c + rows_r) with c = ceil(dim0 / world_size), the last ranks possibly fewer or none. A row block of a
contiguous tensor is a contiguous range of its flattened elements, so a rank's shard is the element range
[begin, end) = rows times the row size: exactly the `ModelPiece`/`OptimPiece` ranges the checkpoint format
speaks ([Note: strategy adapters]), which is why FSDP2 runs resume on the zero backend and back.

The optimizer steps `master`, a plain tensor sharing storage with FSDP2's padded sharded data (the DTensor's
local tensor, detached): FSDP2 all-gathers from that storage, so an in-place step is what the next forward sees.
The storage is stable once `fully_shard` padded it (FSDPParam.reset_sharded_param keeps the same storage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from zeroshard.comm.collectives import Collectives


def row_range(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows [begin, end) of a dim-0 size `dim0` that `rank` holds under `torch.chunk` sharding. Pure."""
    chunk = -(-dim0 // world_size) if dim0 else 0
    begin = min(rank * chunk, dim0)
    return begin, min(begin + chunk, dim0)


def row_numel(shape: tuple[int, ...]) -> int:
    """Elements per dim-0 row of a tensor of `shape`. Pure."""
    n = 1
    for d in shape[1:]:
        n *= d
    return n


@dataclass(frozen=True)
class ShardedParam:
    """A parameter `fully_shard` turned into a DTensor, and this rank's part of it."""

    name: str
    param: nn.Parameter  # the module's (DTensor) parameter: its identity is what users and the checkpoint see
    master: torch.Tensor  # this rank's rows, a plain tensor on FSDP2's sharded storage (what the optimizer steps)
    full_shape: tuple[int, ...]
    begin: int  # element range of the flattened parameter this rank holds
    end: int
    group: int  # optimizer group, -1 when frozen or in no group

    @property
    def trainable(self) -> bool:
        return self.group >= 0

    @property
    def numel(self) -> int:
        return self.end - self.begin

    @property
    def row_numel(self) -> int:
        return row_numel(self.full_shape)

    @property
    def full_numel(self) -> int:
        return self.full_shape[0] * self.row_numel if self.full_shape else 1

    def local_grad(self) -> torch.Tensor | None:
        """This rank's rows of the reduced gradient (FSDP2 keeps it as a DTensor on the parameter)."""
        grad = self.param.grad
        if grad is None:
            return None
        return grad.to_local() if isinstance(grad, DTensor) else grad


def sharded_param(name: str, param: nn.Parameter, group: int, rank: int, world_size: int) -> ShardedParam:
    """The record of one parameter after `fully_shard` (asserting FSDP2's default `Shard(0)` placement). On a
    dp x tp mesh ([Note: tensor parallelism on fsdp2] in tp/fsdp2.py) the "full" tensor is this rank's
    tensor-parallel slice, whose rows FSDP2 shards over dp (`_StridedShard(0)` when tp also splits dim 0)."""
    assert isinstance(param, DTensor), f"{name} is not sharded by fully_shard"
    placements = tuple(param.placements)
    assert isinstance(placements[0], Shard | _StridedShard) and placements[0].dim == 0, (
        f"{name}: expected rows sharded over dp, got {placements}"
    )
    dims = list(param.shape)
    for mesh_dim, placement in enumerate(placements[1:], start=1):  # tensor-parallel dims: the local slice's shape
        if isinstance(placement, Shard | _StridedShard):
            dims[placement.dim] //= param.device_mesh.size(mesh_dim)
    shape = tuple(dims)
    lo, hi = row_range(shape[0] if shape else 1, world_size, rank)
    local = param.to_local().detach()
    row = row_numel(shape)
    assert local.numel() == (hi - lo) * row, f"{name}: local shard {tuple(local.shape)} is not rows [{lo}, {hi})"
    return ShardedParam(name, param, local, shape, lo * row, hi * row, group)


def gather_full(sp: ShardedParam, local: torch.Tensor, comm: Collectives, device: torch.device) -> torch.Tensor:
    """The whole tensor from every rank's rows `local` (shaped like `sp.master`), in fp32 on `device`
    (collective: every rank calls it for the same parameter)."""
    world = comm.world_size
    first, last = row_range(sp.full_shape[0] if sp.full_shape else 1, world, 0)
    chunk = (last - first) * sp.row_numel  # every rank's rows, padded to rank 0's count (the most)
    mine = torch.zeros(chunk, dtype=torch.float32, device=device)
    mine[: local.numel()].copy_(local.reshape(-1))
    everyone = torch.zeros(chunk * world, dtype=torch.float32, device=device)
    comm.all_gather(everyone, mine, label=f"full value of {sp.name!r}")
    return everyone[: sp.full_numel].view(sp.full_shape).clone()


def own_rows(sp: ShardedParam, value: torch.Tensor) -> torch.Tensor:
    """This rank's elements of a whole value of `sp` (flattened), shaped like `sp.master`."""
    flat = value.detach().reshape(-1)
    return flat[sp.begin : sp.end].view(sp.master.shape)
