"""The dp x tp mesh: which data-parallel replica and tensor-parallel position a rank is, and its groups.

[Note: tensor-parallel mesh]
Ranks are laid out as torch's 2-D recipe and Megatron lay them out: rank = dp_index * tp + tp_index, so the `tp`
ranks of one tensor-parallel group are consecutive (inside a node when `tp` divides it: they exchange activations
at every layer) and a data-parallel group is every tp-th rank (where ZeRO shards and gradients are reduced). The
arithmetic is pure (`TensorParallelGrid`); `TensorParallelContext` holds torch's `DeviceMesh` with dimensions
("dp", "tp") and our `Collectives` over its two groups, created in the same order on every rank. With a
Megatron-style `mpu` (`initialize(mpu=...)`) the groups are the mpu's instead ([Note: mpu groups] in tp/mpu.py).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zeroshard.comm.collectives import Collectives, scope_of
from zeroshard.comm.topology import NodeLayout, mesh_backend_override
from zeroshard.errors import ConfigError


@dataclass(frozen=True)
class TensorParallelGrid:
    """Rank arithmetic of a dp x `tp` mesh over `world_size` ranks ([Note: tensor-parallel mesh]). Pure."""

    tp: int
    world_size: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.world_size % self.tp:
            raise ConfigError(
                f"tensor_parallel.autotp_size={self.tp} must divide the world size {self.world_size} (the "
                "data-parallel degree is world_size / autotp_size); launch a multiple of autotp_size ranks"
            )

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    def dp_index(self, rank: int) -> int:
        return rank // self.tp

    def tp_index(self, rank: int) -> int:
        return rank % self.tp

    def tp_ranks(self, dp_index: int) -> list[int]:
        return [dp_index * self.tp + t for t in range(self.tp)]

    def dp_ranks(self, tp_index: int) -> list[int]:
        return [d * self.tp + tp_index for d in range(self.dp)]


@dataclass
class TensorParallelContext:
    """This rank's place in the dp x tp mesh: the tp sub-mesh DTensor plans use, and collectives per dimension."""

    tp_mesh: DeviceMesh | None  # None with an mpu whose model is already split (no DTensor plan applied)
    dp_comm: Collectives
    tp_comm: Collectives
    dp_root: int  # global rank of this data-parallel group's first rank (initial weights come from it)
    loss_parallel: bool = False  # [Note: vocab-parallel loss] in tp/plan.py
    dp_mesh: DeviceMesh | None = None  # the mesh's dp dimension, for FSDP2 ([Note: tensor parallelism on fsdp2])

    def compute_context(self) -> AbstractContextManager[Any]:
        """Entered around the engine's forward and backward: torch's `loss_parallel` when the loss is
        vocab-parallel."""
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    @property
    def tp_size(self) -> int:
        return self.tp_comm.world_size

    @property
    def tp_rank(self) -> int:
        return self.tp_comm.rank

    @classmethod
    def create(
        cls, world: Collectives, tp: int, device: torch.device, loss_parallel: bool = False
    ) -> TensorParallelContext:
        """Collective: every rank calls it with the same `tp`."""
        grid = TensorParallelGrid(tp, world.world_size)
        names = ("dp", "tp")  # with the world's deadline: [Note: sub-groups keep the world's deadline]
        mesh = init_device_mesh(
            device.type,
            (grid.dp, grid.tp),
            mesh_dim_names=names,
            backend_override=mesh_backend_override(device.type, names, (grid.dp, grid.tp)),
        )
        nodes, rank = NodeLayout.from_env(world.world_size), world.rank
        dp_ranks, tp_ranks = grid.dp_ranks(grid.tp_index(rank)), grid.tp_ranks(grid.dp_index(rank))
        dp_comm = world.subgroup(mesh.get_group("dp"), grid.dp, grid.dp_index(rank), scope_of(nodes, dp_ranks))
        tp_comm = world.subgroup(mesh.get_group("tp"), grid.tp, grid.tp_index(rank), scope_of(nodes, tp_ranks))
        return cls(mesh["tp"], dp_comm, tp_comm, dp_ranks[0], loss_parallel, mesh["dp"])
