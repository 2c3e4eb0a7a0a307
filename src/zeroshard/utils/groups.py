"""`deepspeed.utils.groups`: the process groups scripts ask for, those of the engine `initialize` built last.

[Note: groups follow the engine]
DeepSpeed's engine hands its groups to this module (`groups.mpu = ...`, the expert groups by name), and scripts
(Megatron-DeepSpeed, DeepSpeed's own examples) ask here instead of the engine. `initialize` does the same: it
`publish`es the engine's data-parallel group (the stage's under a pipeline, the mpu's or AutoTP's under tensor
parallelism), its tensor-parallel group and the MoE layers' expert groups. Before any engine (or after an engine
without them) the answers are pure data parallelism's: the data-parallel group is the world, model-parallel groups
have one rank. As in DeepSpeed, the last engine built is the one answered for: a script with two engines over
different meshes should ask each engine (`engine.dp_world_size`, `engine.pipe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from zeroshard.comm.collectives import Collectives
    from zeroshard.moe.groups import ExpertGroups
    from zeroshard.sequence.mesh import SequenceParallel


@dataclass(frozen=True)
class EngineGroups:
    """What one engine trains over: its data-parallel and tensor-parallel collectives, expert groups by name
    (`"ep_size_2"`, DeepSpeed's naming) and sequence-parallel groups. `dp` is what ZeRO shards over: with sequence
    parallelism the whole world, DeepSpeed's "sequence data parallel" group, while the data-parallel accessors
    answer the replicas' group ([Note: sequence parallelism])."""

    dp: Collectives
    tp: Collectives | None = None
    experts: dict[str, ExpertGroups] = field(default_factory=dict)
    sequence: SequenceParallel | None = None

    @property
    def replicas(self) -> Collectives:
        return self.sequence.dp if self.sequence is not None else self.dp


# DeepSpeed's `groups.mpu`: the mpu the engine built last was given, this module under AutoTP (`publish` sets it, as
# DeepSpeed's engine does, and leaves it after `destroy`), or one a script set; `moe.mappings` reads it
mpu: Any = None


class _Published:
    """The groups of the engine built last ([Note: groups follow the engine]); one per process. They count only
    while the process group they were made in is the current one (a script may destroy it without `destroy`)."""

    def __init__(self) -> None:
        self._groups: EngineGroups | None = None
        self._world: object = None

    def set(self, groups: EngineGroups | None) -> None:
        self._groups, self._world = groups, (dist.group.WORLD if groups is not None else None)

    @property
    def groups(self) -> EngineGroups | None:
        if self._groups is None or not _initialized() or dist.group.WORLD is not self._world:
            return None
        return self._groups


_PUBLISHED = _Published()


def publish(groups: EngineGroups | None, engine_mpu: Any = None) -> None:
    """`initialize` calls this with the engine's groups once the engine exists (None: pure data parallelism), and the
    mpu it was given, which becomes `mpu` as DeepSpeed's engine sets it (an mpu of the AutoTP mesh is AutoTP's)."""
    global mpu
    _PUBLISHED.set(groups)
    if engine_mpu is not None:
        mpu = engine_mpu


def withdraw(dp: Collectives) -> None:
    """An engine over `dp` is destroyed: if it is the one published, back to pure data parallelism."""
    published = _PUBLISHED.groups
    if published is not None and published.dp is dp:
        _PUBLISHED.set(None)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _group(comm: Collectives) -> dist.ProcessGroup | None:
    """[Note: a one-rank group]
    The engine's collectives over the whole world or over one rank need no process group of their own (`group`
    None), but a script that asks for the group runs its own collectives over it: a one-rank group (an expert group
    of `ep_size=1`, the expert-data-parallel group when `ep_size` is the world) must be one rank's, as DeepSpeed's
    are, or an all-reduce over it would sum the world's tensors (the group of other experts). It is made here on first
    asking, by this rank alone (`use_local_synchronization`: no other rank takes part), once per world."""
    if comm.group is not None:
        return comm.group
    if comm.world_size > 1 or not _initialized() or dist.get_world_size() == 1:
        return dist.group.WORLD  # type: ignore[return-value]
    from zeroshard.comm.topology import world_timeout  # (comm imports this module)

    key = (id(dist.group.WORLD), dist.get_rank())
    if key not in _SINGLETONS:
        _SINGLETONS[key] = dist.new_group([dist.get_rank()], timeout=world_timeout(), use_local_synchronization=True)
    return _SINGLETONS[key]


_SINGLETONS: dict[tuple[int, int], dist.ProcessGroup] = {}  # (the world's id, rank) -> its one-rank group


def get_data_parallel_group() -> dist.ProcessGroup | None:
    """The data-parallel group (the world without an engine's mesh; None before torch.distributed is initialised)."""
    published = _PUBLISHED.groups
    if published is not None:
        return _group(published.replicas)
    return dist.group.WORLD if _initialized() else None  # type: ignore[return-value]


def get_data_parallel_world_size() -> int:
    """Ranks in the data-parallel group (1 before torch.distributed is initialised)."""
    published = _PUBLISHED.groups
    if published is not None:
        return published.replicas.world_size
    return dist.get_world_size() if _initialized() else 1


def get_data_parallel_rank() -> int:
    """This process's rank in the data-parallel group (0 before torch.distributed is initialised)."""
    published = _PUBLISHED.groups
    if published is not None:
        return published.replicas.rank
    return dist.get_rank() if _initialized() else 0


def _get_data_parallel_group_ranks() -> list[int]:
    """The global ranks of this process's data-parallel group."""
    group = get_data_parallel_group()
    if group is None:
        return [0]
    return dist.get_process_group_ranks(group)


def get_tensor_model_parallel_group() -> dist.ProcessGroup | None:
    """The tensor-parallel group (None when the engine has no tensor parallelism)."""
    published = _PUBLISHED.groups
    return _group(published.tp) if published is not None and published.tp is not None else None


def get_model_parallel_world_size() -> int:
    """Ranks in the tensor (model) parallel group: 1 without tensor parallelism."""
    published = _PUBLISHED.groups
    return published.tp.world_size if published is not None and published.tp is not None else 1


def get_model_parallel_rank() -> int:
    """This process's rank in the tensor (model) parallel group: 0 without tensor parallelism."""
    published = _PUBLISHED.groups
    return published.tp.rank if published is not None and published.tp is not None else 0


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this process's tensor-parallel group."""
    group = get_tensor_model_parallel_group()
    if group is None:
        return dist.get_rank() if _initialized() else 0
    return min(dist.get_process_group_ranks(group))


def _all_experts() -> dict[str, ExpertGroups]:
    """The engine's expert groups by name, and those a script made (`_create_expert_and_data_parallel`)."""
    published = _PUBLISHED.groups
    made = _MADE.get(id(dist.group.WORLD), {}) if _initialized() else {}
    return {**made, **(published.experts if published is not None else {})}


def _experts(group_name: str) -> ExpertGroups:
    groups = _all_experts().get(group_name)
    if groups is None:
        known = sorted(_all_experts())
        raise KeyError(f"no expert groups named {group_name!r} (the engine's MoE layers have {known})")
    return groups


_MADE: dict[int, dict[str, ExpertGroups]] = {}  # the world's id -> expert groups a script made, by name


def _create_expert_and_data_parallel(
    expert_parallel_size_: int,
    mp_size: int | None = None,
    pp_size: int | None = None,
    mp_mode: str = "tp",
    use_data_before_expert_parallel_: bool = False,
    folding_spec: Any = None,
) -> None:
    """DeepSpeed's: make the expert-parallel and expert-data-parallel groups of `expert_parallel_size_` over the
    world (collective: every rank), named `ep_size_N` as an engine's MoE layers name theirs (an engine's own win).
    DeepSpeed's engine calls it for its MoE layers; scripts and its tests call it to use the groups without an
    engine. Only the world's "E + D" / "D + E" layouts: model or pipeline parallel sizes above 1 are refused. A second
    call for the same size keeps the first groups (DeepSpeed's skips a size it has)."""
    from zeroshard.moe.groups import ExpertGroups

    if (mp_size or 1) > 1 or (pp_size or 1) > 1 or folding_spec is not None:
        raise ValueError(
            "_create_expert_and_data_parallel: only expert groups over the whole world are made here (mp_size, "
            "pp_size and folding_spec are not supported); an engine makes those of its own mesh"
        )
    if not _initialized():
        raise RuntimeError("_create_expert_and_data_parallel: torch.distributed is not initialized")
    made = _MADE.setdefault(id(dist.group.WORLD), {})
    if f"ep_size_{expert_parallel_size_}" in made:  # made before: kept, as DeepSpeed keeps its first groups
        return
    groups = ExpertGroups(expert_parallel_size_)
    groups.use_topology(use_data_before_expert_parallel_)
    made[f"ep_size_{expert_parallel_size_}"] = groups


def _get_expert_parallel_ranks(
    world_size: int,
    tensor_parallel_size_: int,
    expert_parallel_size_: int,
    pipeline_parallel_size_: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's layout of the expert-parallel and expert-data-parallel groups over a mesh of pipeline stages
    (blocks of world / pp ranks), tensor-parallel neighbours and data-parallel replicas. Pure: the rank lists.

    Each stage's data-parallel ranks of one tensor-parallel index (every tp-th rank; "D + E": gathered in
    expert-sized strides) are cut into consecutive expert-parallel groups of `expert_parallel_size_`; the ranks at
    one position of those groups form an expert-data-parallel group.

    Example:
        >>> _get_expert_parallel_ranks(8, 2, 2)[0]
        [[0, 2], [4, 6], [1, 3], [5, 7]]
    """
    tp, ep, pp = tensor_parallel_size_, expert_parallel_size_, pipeline_parallel_size_
    if world_size % (tp * pp) or (world_size // (tp * pp)) % ep:
        raise ValueError(
            f"_get_expert_parallel_ranks: {world_size} ranks do not split into tensor-parallel {tp} x pipeline {pp} "
            f"with data-parallel groups divisible by the expert-parallel size {ep}"
        )
    dp, stage_size = world_size // (tp * pp), world_size // pp
    data_groups = []
    for start in range(0, world_size, stage_size):
        for i in range(tp):
            if use_data_before_expert_parallel_:
                stride = dp // ep  # replicas of one expert sit this many tensor-parallel blocks apart
                ranks = [r for d in range(stride) for r in range(start + i + d * tp, start + stage_size, stride * tp)]
            else:
                ranks = list(range(start + i, start + stage_size, tp))
            data_groups.append(ranks)
    expert_groups: list[list[int]] = []
    expert_data_groups: list[list[int]] = []
    for ranks in data_groups:
        parts = [ranks[j : j + ep] for j in range(0, dp, ep)]
        expert_groups.extend(parts)
        expert_data_groups.extend(list(column) for column in zip(*parts, strict=True))
    return expert_groups, expert_data_groups


def _get_expert_parallel_group_dict() -> dict[str, dist.ProcessGroup | None]:
    """This rank's expert-parallel group of every expert mesh, by name."""
    return {name: _group(groups.ep) for name, groups in _all_experts().items()}


def _get_broadcast_src_rank() -> int:
    """The global rank of the first rank of the group ZeRO shards over (what DeepSpeed broadcasts from)."""
    group = _get_sequence_data_parallel_group()
    return dist.get_global_rank(group, 0) if group is not None else 0


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert-data-parallel group of `group_name`."""
    group = _get_expert_data_parallel_group(group_name)
    return dist.get_global_rank(group, 0) if group is not None else 0


def _get_expert_parallel_group(group_name: str) -> dist.ProcessGroup | None:
    return _group(_experts(group_name).ep)


def _get_expert_data_parallel_group(group_name: str) -> dist.ProcessGroup | None:
    return _group(_experts(group_name).edp)


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _experts(group_name).ep.world_size


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _experts(group_name).edp.world_size


def _get_expert_parallel_rank(group_name: str) -> int:
    return _experts(group_name).ep.rank


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _experts(group_name).edp.rank


def _get_max_expert_size_name() -> str:
    """The name of the largest expert-parallel size among the engine's MoE layers."""
    every = _all_experts()
    names = sorted(every, key=lambda n: every[n].mesh.ep_size)
    if not names:
        raise KeyError("the engine has no MoE layers with expert parallelism")
    return names[-1]


def _get_max_expert_size() -> int:
    return _experts(_get_max_expert_size_name()).mesh.ep_size


def _get_max_expert_parallel_group() -> dist.ProcessGroup | None:
    """This rank's expert-parallel group of the largest expert-parallel size (where an overflow check meets)."""
    return _get_expert_parallel_group(_get_max_expert_size_name())


def sequence_parallel_collectives() -> Collectives | None:
    """The engine's sequence-parallel collectives (None without sequence parallelism)."""
    published = _PUBLISHED.groups
    return published.sequence.sp if published is not None and published.sequence is not None else None


def _get_sequence_parallel_world_size() -> int:
    """Ranks that split one sample's sequence: 1 without sequence parallelism."""
    sp = sequence_parallel_collectives()
    return sp.world_size if sp is not None else 1


def _get_sequence_parallel_rank() -> int:
    sp = sequence_parallel_collectives()
    return sp.rank if sp is not None else 0


def _get_sequence_parallel_group() -> dist.ProcessGroup | None:
    """The sequence-parallel group; KeyError without one, as DeepSpeed's."""
    sp = sequence_parallel_collectives()
    if sp is None:
        raise KeyError("No sequence parallel group found")
    return _group(sp)


def _sequence_data_parallel() -> Collectives | None:
    published = _PUBLISHED.groups
    return published.dp if published is not None else None


def _get_sequence_data_parallel_group() -> dist.ProcessGroup | None:
    """What ZeRO shards and reduces over: the whole world with sequence parallelism, else the data-parallel
    group."""
    comm = _sequence_data_parallel()
    if comm is not None:
        return _group(comm)
    return dist.group.WORLD if _initialized() else None  # type: ignore[return-value]


def _get_sequence_data_parallel_world_size() -> int:
    comm = _sequence_data_parallel()
    if comm is not None:
        return comm.world_size
    return dist.get_world_size() if _initialized() else 1


def _get_sequence_data_parallel_rank() -> int:
    comm = _sequence_data_parallel()
    if comm is not None:
        return comm.rank
    return dist.get_rank() if _initialized() else 0


def _get_expert_model_parallel_world_size() -> int:
    """1: experts are not split by tensor parallelism here (`enable_expert_tensor_parallelism` is refused)."""
    return 1


# DeepSpeed's other spellings, which its own examples and tests call.
_get_data_parallel_group = get_data_parallel_group
_get_data_parallel_world_size = get_data_parallel_world_size
_get_data_parallel_rank = get_data_parallel_rank
_get_model_parallel_world_size = get_model_parallel_world_size
get_model_parallel_group = get_tensor_model_parallel_group
get_tensor_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_rank = get_model_parallel_rank
