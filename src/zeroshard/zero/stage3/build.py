"""Building stage 3 on one rank: units planned, materialised and sharded one at a time, sub-groups fixed once.

No rank ever holds the whole model: a meta-device model is materialised unit by unit, each unit's full
parameters are copied into its shard and released before the next unit exists, and with NVMe offload each
master and shard goes to disk as soon as its unit is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from zeroshard.offload.gradients import GradientTier, GradShard
from zeroshard.offload.tier import Tier
from zeroshard.precision.cast import cast_floating_buffers
from zeroshard.utils.chunks import greedy_chunks
from zeroshard.zero.stage3.plan import PERSISTENT, UnitLayout, UnitPolicy, layout_unit, plan_units
from zeroshard.zero.stage3.unit import ShardedUnit
from zeroshard.zero.strategy import ParamGroupSpec


@dataclass(frozen=True)
class Piece:
    """The part of one unit's owned range that belongs to one optimizer group: the optimizer steps `master`."""

    unit: ShardedUnit
    master: torch.Tensor  # a view into unit.master
    grad: torch.Tensor  # the same range of unit.grad_shard

    @property
    def offset(self) -> int:
        """Where the piece starts in the unit's shard."""
        return int(self.master.storage_offset() - self.unit.master.storage_offset())


@dataclass(frozen=True)
class SubGroup:
    """Consecutive units stepped together: one optimizer call, one set of fp32 gradient temporaries and one NVMe
    swap entry (`key`) per chunk of about `sub_group_size` shard elements, as DeepSpeed's sub-groups."""

    key: str
    units: list[ShardedUnit]


@dataclass
class BuiltUnits:
    units: list[ShardedUnit]
    pieces: list[list[Piece]]  # per optimizer group, in unit order
    sub_groups: list[SubGroup]
    placeholders: list[torch.Tensor] = field(default_factory=list)  # groups this rank owns nothing of


@dataclass(frozen=True)
class BuildPolicy:
    compute_dtype: torch.dtype
    grad_dtype: torch.dtype
    persistence_threshold: int
    sub_group_numel: int
    unit_policy: UnitPolicy | None
    master_tier: Tier
    param_tier: Tier


def build_units(
    module: nn.Module,
    groups: Sequence[ParamGroupSpec],
    policy: BuildPolicy,
    shard_rank: int,
    world_size: int,
    device: torch.device,
    gradients: GradientTier,
) -> BuiltUnits:
    group_of = {id(p): gi for gi, g in enumerate(groups) for _, p in g.params}
    frozen_group = len(groups)
    named = dict(module.named_parameters())
    modules = dict(module.named_modules())
    specs = plan_units(module, policy.unit_policy, policy.persistence_threshold)
    layouts: list[UnitLayout] = []
    for spec in specs:
        rows = [(n, named[n].numel(), group_of.get(id(named[n]), frozen_group)) for n in spec.param_names]
        layouts.append(layout_unit(rows, world_size))
    chunks = greedy_chunks([layout.shard_numel for layout in layouts], policy.sub_group_numel, close="after")
    chunk_of = {index: k for k, members in enumerate(chunks) for index in members}
    store = policy.master_tier.residency
    built = BuiltUnits([], [[] for _ in groups], [SubGroup(f"subgroup{k}", []) for k in range(len(chunks))])
    for index, (spec, layout) in enumerate(zip(specs, layouts, strict=True)):
        params = [named[n] for n in spec.param_names]
        _materialize(modules, spec.param_names, params, device, index)
        unit = ShardedUnit(
            index,
            spec.name,
            None if spec.name == PERSISTENT else modules[spec.name],
            layout,
            params,
            shard_rank,
            policy.compute_dtype,
            policy.grad_dtype,
            device,
            policy.master_tier,
            policy.param_tier,
        )
        unit.release()
        unit.grad_copy = gradients.copy_for(unit.grad_shard, unit.master) if unit.trainable else None
        built.units.append(unit)
        built.sub_groups[chunk_of[index]].units.append(unit)
        for group, begin, end in layout.group_pieces(shard_rank):
            if group < len(groups):
                master, grad = unit.master.narrow(0, begin, end - begin), unit.grad_shard.narrow(0, begin, end - begin)
                built.pieces[group].append(Piece(unit, master, grad))
        unit.place_shard()
        # NVMe: each master goes to disk as soon as it exists (the optimizer state follows after a step)
        store.place(built.sub_groups[chunk_of[index]].key, [] if unit.master is unit.shard else [unit.master])
        gradients.place(GradShard(unit.grad_key, unit.grad_shard, bool(unit.trainable)))
        unit.zero_grad_shard()
    cast_floating_buffers(module, policy.compute_dtype)
    return built


def _materialize(
    modules: dict[str, nn.Module], names: Sequence[str], params: list[nn.Parameter], device: torch.device, seed: int
) -> None:
    """Meta-device parameters become real, one unit at a time, initialised by their modules' own
    reset_parameters() under a per-unit seed shared by every rank: no rank ever holds the full model."""
    if not any(p.is_meta for p in params):
        return
    owners = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n in names})
    root = modules[""]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch.initial_seed() + seed)
        for owner in owners:
            module = modules[owner]
            own = list(module.parameters(recurse=False))
            if not all(p.is_meta for p in own):
                continue  # initialised with an earlier unit that shares this module
            for p in own:  # the whole module, also parameters another unit will shard later
                _make_real(p, device)
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            init = getattr(root, "_init_weights", None)
            if callable(init):
                init(module)
    for p in params:
        if p.is_meta:
            _make_real(p, device, zero=True)


def _make_real(param: nn.Parameter, device: torch.device, zero: bool = False) -> None:
    """Give a meta parameter real storage in place: the Python object (and every reference to it,
    tied weights included) stays the same; `.data =` cannot change a tensor's device type."""
    alloc = torch.zeros if zero else torch.empty
    real = nn.Parameter(alloc(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, real)
