"""Expert-parallel and expert-data-parallel groups: the rank arithmetic (pure) and the process groups.

[Note: expert groups]
With `ep` the expert-parallel size and `W` ranks, as DeepSpeed's `groups._create_expert_and_data_parallel` lays
them out: the expert-parallel groups are consecutive blocks `[0..ep)`, `[ep..2ep)`, ... (one copy of all experts
each, inside a node when `ep` divides the node), and the expert-data-parallel groups are the strided sets
`{r, r+ep, r+2ep, ...}`: the `W/ep` ranks holding the same experts, over which those experts' gradients are
reduced and their optimizer state is sharded. Non-expert parameters stay data-parallel over all `W` ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zeroshard.comm.collectives import Collectives, Scope
from zeroshard.comm.topology import NodeLayout


@dataclass(frozen=True)
class ExpertMesh:
    """[Note: expert groups] for `world_size` ranks and expert-parallel size `ep_size`. Pure."""

    world_size: int
    ep_size: int

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.world_size % self.ep_size:
            raise ValueError(
                f"ep_size={self.ep_size} must divide the number of ranks ({self.world_size}): the experts are split "
                "over ep_size ranks and replicated world_size / ep_size times"
                + ("; build MoE layers after zeroshard.init_distributed()" if self.world_size == 1 else "")
            )

    @property
    def edp_size(self) -> int:
        return self.world_size // self.ep_size

    def ep_groups(self) -> list[list[int]]:
        return [list(range(s, s + self.ep_size)) for s in range(0, self.world_size, self.ep_size)]

    def edp_groups(self) -> list[list[int]]:
        return [list(range(r, self.world_size, self.ep_size)) for r in range(self.ep_size)]

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep_size

    def edp_rank(self, rank: int) -> int:
        return rank // self.ep_size


class ExpertGroups:
    """The process groups of one `ExpertMesh` on this rank. Collective to build: every rank, the same order.

    One object can serve many MoE layers with the same `ep_size` (pass it as `MoE(..., expert_groups=...)`);
    otherwise each layer builds its own.
    """

    def __init__(self, ep_size: int):
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        self.mesh = ExpertMesh(world, ep_size)
        self.rank = rank
        nodes = NodeLayout.from_env(world)
        self.ep = self._build(self.mesh.ep_groups(), nodes)
        self.edp = self._build(self.mesh.edp_groups(), nodes)

    def _build(self, all_groups: list[list[int]], nodes: NodeLayout) -> Collectives:
        mine = next(g for g in all_groups if self.rank in g)
        scope = Scope.INTER_NODE if nodes.spans_nodes(mine) else Scope.INTRA_NODE
        if len(mine) == 1:
            return Collectives(None, 1, 0, scope=scope)
        if len(mine) == self.mesh.world_size:
            return Collectives(None, len(mine), mine.index(self.rank), scope=scope)
        made = {tuple(g): dist.new_group(g) for g in all_groups}  # every rank creates every group
        return Collectives(made[tuple(mine)], len(mine), mine.index(self.rank), scope=scope)

    def broadcast_experts(self, params: Sequence[torch.Tensor]) -> None:
        """The experts start from the first rank of their expert-data-parallel group (the world's rank 0 holds
        only its own experts), as DeepSpeed's engine broadcasts them."""
        for param in params:
            self.edp.broadcast(param.data, src=self.mesh.ep_rank(self.rank), label="moe.expert_broadcast")

    def counted_by(self, world: Collectives) -> None:
        """Count this mesh's collectives in `world`'s counters (the engine's), as its sub-groups do."""
        self.ep = world.subgroup(self.ep.group, self.ep.world_size, self.ep.rank, self.ep.scope)
        self.edp = world.subgroup(self.edp.group, self.edp.world_size, self.edp.rank, self.edp.scope)
