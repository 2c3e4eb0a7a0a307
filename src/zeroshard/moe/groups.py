"""Expert-parallel and expert-data-parallel groups: the rank arithmetic (pure) and the process groups.

[Note: expert groups]
With `ep` the expert-parallel size and `W` ranks, as DeepSpeed's `groups._create_expert_and_data_parallel` lays
them out: the expert-parallel groups are consecutive blocks `[0..ep)`, `[ep..2ep)`, ... (one copy of all experts
each, inside a node when `ep` divides the node), and the expert-data-parallel groups are the strided sets
`{r, r+ep, r+2ep, ...}`: the `W/ep` ranks holding the same experts, over which those experts' gradients are
reduced and their optimizer state is sharded. Non-expert parameters stay data-parallel over all `W` ranks.
With `use_data_before_expert_parallelism` (DeepSpeed's "D + E" topology) it is the other way round: the
expert-data-parallel groups are the consecutive blocks of `W/ep` ranks and the expert-parallel groups the strided
sets `{i, i + W/ep, ...}` (the all-to-all crosses nodes, the experts' gradient reduction stays inside one);
`initialize` rebuilds the groups so before it uses them, as DeepSpeed's engine builds its groups then.

[Note: expert groups in a pipeline]
In a PipelineModule of several stages the same layout holds within each stage's data-parallel ranks (`W` = dp,
counted from the stage's first rank `base`), as DeepSpeed lays out its expert groups per stage for pipeline models.
A MoE layer is built by its stage's ranks only (`LayerSpec`), so it cannot make groups then (every rank of the world
takes part in a group's creation): it takes the stage's mesh and leaves its groups pending, and
`initialize` makes every stage's pending groups on every rank, in one order (`make_stage_groups`), before the
engine uses them. A layer built outside the PipelineModule has groups over the whole world and is refused there.

[Note: expert groups shared by layers]
MoE layers built without `expert_groups=` (every DeepSpeed model: its layers never pass groups) share one pair of
process groups per mesh, as DeepSpeed's `groups` keeps one `ep_size_N` pair for all of them: a group per layer
would cost, on NCCL, two communicators per layer (their buffers in device memory, their set-up at the first
collective), 64 for a 32-layer model. The pairs are kept per default process group (a group made for another
default group is never reused); every rank builds the same layers in one order, so every rank reaches the same
`new_group` calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from zeroshard.comm.collectives import Collectives, Scope
from zeroshard.comm.topology import NodeLayout, new_group
from zeroshard.pipe.layers import stage_being_built


@dataclass(frozen=True)
class ExpertMesh:
    """[Note: expert groups] for `world_size` ranks and expert-parallel size `ep_size`. Pure."""

    world_size: int
    ep_size: int
    base: int = 0  # the global rank of the mesh's first rank ([Note: expert groups in a pipeline])
    data_first: bool = False  # DeepSpeed's use_data_before_expert_parallelism ("D + E")

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
        """Global ranks of each expert-parallel group."""
        return self._strided() if self.data_first else self._blocks(self.ep_size)

    def edp_groups(self) -> list[list[int]]:
        """Global ranks of each expert-data-parallel group."""
        return self._blocks(self.edp_size) if self.data_first else self._strided()

    def _blocks(self, size: int) -> list[list[int]]:
        return [[self.base + r for r in range(s, s + size)] for s in range(0, self.world_size, size)]

    def _strided(self) -> list[list[int]]:
        stride = self.edp_size if self.data_first else self.ep_size
        return [[self.base + r for r in range(s, self.world_size, stride)] for s in range(stride)]

    def ep_rank(self, rank: int) -> int:
        """Global `rank`'s position in its expert-parallel group (which experts it holds)."""
        local = rank - self.base
        return local // self.edp_size if self.data_first else local % self.ep_size

    def edp_rank(self, rank: int) -> int:
        local = rank - self.base
        return local % self.edp_size if self.data_first else local // self.ep_size

    def edp_root(self, rank: int) -> int:
        """The global rank that starts `rank`'s expert-data-parallel group (whose experts every member starts from)."""
        return next(group[0] for group in self.edp_groups() if rank in group)


class ExpertGroups:
    """The process groups of one `ExpertMesh` on this rank. Collective to build: every rank, the same order.

    One object can serve many MoE layers with the same `ep_size` (pass it as `MoE(..., expert_groups=...)`);
    otherwise each layer builds its own, over the process groups layers of its mesh share ([Note: expert groups
    shared by layers]).
    """

    def __init__(self, ep_size: int):
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        self.rank = rank
        stage = stage_being_built()
        # [Note: expert groups in a pipeline]: the stage's mesh, its groups made later by make_stage_groups
        self.staged = self.pending = ep_size > 1 and stage is not None and stage.num_stages > 1
        if self.pending:
            assert stage is not None
            self.mesh = ExpertMesh(stage.size, ep_size, stage.first)
            return
        self.mesh = ExpertMesh(world, ep_size)
        self.ep, self.edp = shared_collectives(self.mesh, rank, world)

    def broadcast_experts(self, params: Sequence[torch.Tensor]) -> None:
        """The experts start from the first rank of their expert-data-parallel group (the world's rank 0 holds
        only its own experts), as DeepSpeed's engine broadcasts them."""
        for param in params:
            self.edp.broadcast(param.data, src=self.mesh.edp_root(self.rank), label="moe.expert_broadcast")

    def use_topology(self, data_first: bool) -> None:
        """DeepSpeed's "E + D" (false) or "D + E" (true) layout ([Note: expert groups]); new groups are made when it
        changes (collective: every rank, every mesh, one order), a pipeline's pending ones by `make_stage_groups`."""
        if self.mesh.data_first == data_first:
            return
        self.mesh = replace(self.mesh, data_first=data_first)
        if not self.pending:
            world = dist.get_world_size() if dist.is_initialized() else 1
            self.ep, self.edp = shared_collectives(self.mesh, self.rank, world)

    def counted_by(self, world: Collectives) -> None:
        """Count this mesh's collectives in `world`'s counters (the engine's), as its sub-groups do."""
        self.ep = world.subgroup(self.ep.group, self.ep.world_size, self.ep.rank, self.ep.scope)
        self.edp = world.subgroup(self.edp.group, self.edp.world_size, self.edp.rank, self.edp.scope)


_SHARED: dict[tuple[int, int, int, bool, int], tuple[Collectives, Collectives]] = {}
_SHARED_UNDER: list[object] = [None]  # the default process group `_SHARED` was made under


def shared_collectives(mesh: ExpertMesh, rank: int, world: int) -> tuple[Collectives, Collectives]:
    """`build_collectives`, one pair per mesh under the current default process group ([Note: expert groups shared
    by layers])."""
    under = dist.group.WORLD if dist.is_initialized() else None
    if _SHARED_UNDER[0] is not under:
        _SHARED.clear()
        _SHARED_UNDER[0] = under
    # (the node layout too: it decides whether a group's traffic counts as inside a node)
    key = (mesh.base, mesh.world_size, mesh.ep_size, mesh.data_first, NodeLayout.from_env(world).ranks_per_node)
    if key not in _SHARED:
        _SHARED[key] = build_collectives(mesh, rank, world)
    return _SHARED[key]


def build_collectives(mesh: ExpertMesh, rank: int, world: int) -> tuple[Collectives, Collectives]:
    """`rank`'s (expert-parallel, expert-data-parallel) collectives of `mesh`. Every rank of the world calls it
    for every mesh, in one order (a mesh of other ranks gives placeholders of size 1)."""
    nodes = NodeLayout.from_env(world)

    def group(all_groups: list[list[int]]) -> Collectives:
        mine = next((g for g in all_groups if rank in g), [rank])
        scope = Scope.INTER_NODE if nodes.spans_nodes(mine) else Scope.INTRA_NODE
        if len(all_groups[0]) == 1:
            return Collectives(None, 1, 0, scope=scope)
        if len(all_groups[0]) == world:
            return Collectives(None, world, mine.index(rank), scope=scope)
        made = {tuple(g): new_group(g) for g in all_groups}  # every rank creates every group
        return Collectives(made.get(tuple(mine)), len(mine), mine.index(rank), scope=scope)

    return group(mesh.ep_groups()), group(mesh.edp_groups())


def make_stage_groups(layers: Sequence[ExpertGroups], world: Collectives) -> None:
    """[Note: expert groups in a pipeline] Make the pending groups of every stage's MoE layers, on every rank:
    each rank reports the (first rank, size, ep_size) meshes it holds, all ranks make the union's groups in one
    order, and each pending `ExpertGroups` takes its mesh's. Groups of one mesh are shared by its layers (as one
    `expert_groups=` object would be). Collective over the world."""
    mine = sorted({(g.mesh.base, g.mesh.world_size, g.mesh.ep_size, g.mesh.data_first) for g in layers if g.pending})
    every: list[list[tuple[int, int, int, bool]]] = [[] for _ in range(world.world_size)]
    if world.world_size > 1:
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    made = {
        key: build_collectives(ExpertMesh(key[1], key[2], key[0], key[3]), world.rank, world.world_size)
        for key in sorted({mesh for rank_meshes in every for mesh in rank_meshes})
    }
    for groups in layers:
        if groups.pending:
            mesh = groups.mesh
            groups.ep, groups.edp = made[(mesh.base, mesh.world_size, mesh.ep_size, mesh.data_first)]
            groups.pending = False
