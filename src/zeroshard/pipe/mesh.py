"""The pp x dp mesh: which stage and data-parallel replica a rank is, and its process groups.

[Note: pipeline mesh]
Ranks are laid out as DeepSpeed's `PipeDataParallelTopology` (axes pipe, data): rank = stage * dp + replica, so
the ranks of one stage are consecutive (one data-parallel group per stage, where ZeRO shards) and a pipeline is
every dp-th rank (one pipeline group per replica, where activations travel). The arithmetic is pure (`PipeGrid`);
`PipeGroups` holds the process groups, created in the same order on every rank. With an mpu's tensor-parallel
layers a "replica" is a (data-parallel, tensor-parallel) lane and ZeRO shards over the mpu's group instead
([Note: 3D mesh] in pipe/three_d.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from zeroshard.comm.topology import new_group
from zeroshard.errors import ConfigError


@dataclass(frozen=True)
class PipeGrid:
    """Rank arithmetic of a `stages` x `dp` mesh ([Note: pipeline mesh])."""

    stages: int
    world_size: int

    def __post_init__(self) -> None:
        if self.stages < 1 or self.world_size % self.stages:
            raise ConfigError(
                f"num_stages={self.stages} must divide the world size {self.world_size} (the data-parallel "
                "degree is world_size / num_stages)"
            )

    @property
    def dp(self) -> int:
        return self.world_size // self.stages

    def stage_of(self, rank: int) -> int:
        return rank // self.dp

    def replica_of(self, rank: int) -> int:
        return rank % self.dp

    def dp_ranks(self, stage: int) -> list[int]:
        return [stage * self.dp + r for r in range(self.dp)]

    def pp_ranks(self, replica: int) -> list[int]:
        return [s * self.dp + replica for s in range(self.stages)]

    def tie_ranks(self, replica: int, stages: list[int]) -> list[int]:
        return [s * self.dp + replica for s in sorted(stages)]


@dataclass
class PipeGroups:
    """This rank's process groups in the mesh (None where a group has one rank)."""

    grid: PipeGrid
    rank: int
    dp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    tie_groups: dict[str, tuple[dist.ProcessGroup | None, list[int]]]

    @property
    def stage(self) -> int:
        return self.grid.stage_of(self.rank)

    @property
    def replica(self) -> int:
        return self.grid.replica_of(self.rank)

    @classmethod
    def create(cls, grid: PipeGrid, rank: int, tied_stages: dict[str, list[int]]) -> PipeGroups:
        """Every rank calls this with the same arguments: groups are created in one global order."""
        dp_group = pp_group = None
        for stage in range(grid.stages):
            group = new_group(grid.dp_ranks(stage))
            if grid.stage_of(rank) == stage:
                dp_group = group
        for replica in range(grid.dp):
            group = new_group(grid.pp_ranks(replica))
            if grid.replica_of(rank) == replica:
                pp_group = group
        ties: dict[str, tuple[dist.ProcessGroup | None, list[int]]] = {}
        for key in sorted(tied_stages):
            for replica in range(grid.dp):
                ranks = grid.tie_ranks(replica, tied_stages[key])
                group = new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    ties[key] = (group, ranks)
        return cls(grid, rank, dp_group, pp_group, ties)
