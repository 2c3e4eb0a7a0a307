"""Building stage 3 on one rank: units planned, materialised and sharded one at a time, sub-groups fixed once.

No rank ever holds the whole model: a meta-device model is materialised unit by unit, each unit's full
parameters are copied into its shard and released before the next unit exists, and with NVMe offload each
master and shard goes to disk as soon as its unit is built. A model `zero_init` built from a checkpoint is read
straight into the shards ([Note: streaming load]): a unit the checkpoint covers is never materialised.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from zeroshard.comm.collectives import Collectives
from zeroshard.loading.materialize import initialise, load_parameters, make_real
from zeroshard.loading.weights import StreamedWeights
from zeroshard.offload.gradients import GradientTier, GradShard
from zeroshard.offload.tier import Tier
from zeroshard.utils.chunks import greedy_chunks
from zeroshard.utils.logging import get_logger
from zeroshard.zero.quant import BlockQuantizer
from zeroshard.zero.stage3.ds_param import number
from zeroshard.zero.stage3.pending import BUILT
from zeroshard.zero.stage3.plan import (
    NO_LEAVES,
    PERSISTENT,
    LeafModules,
    UnitLayout,
    UnitPolicy,
    layout_unit,
    plan_units,
)
from zeroshard.zero.stage3.unit import ShardedUnit
from zeroshard.zero.strategy import ParamGroupSpec

logger = get_logger(__name__)


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
    tier: Tier  # where its masters and optimizer state live ([Note: partial offload])


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
    weights: StreamedWeights | None = None  # the checkpoint of a model `zero_init` built from one
    init_source: int | None = None  # the rank whose initialisation every rank takes: [Note: one start on every rank]
    keeps_gradients: bool = True  # False: inference without an optimizer
    # the persistent unit (reduced only when backward ends) in a sub-group of its own, not in the last layers' one,
    # so that sub-group can be stepped during backward ([Note: speculative host steps])
    persistent_alone: bool = False
    model_persistence_threshold: int = sys.maxsize  # [Note: units] in plan.py
    leaves: LeafModules = NO_LEAVES  # [Note: leaf modules] in plan.py
    master_dtype: torch.dtype = torch.float32  # [Note: bf16 master weights] in optim/state_dtype.py
    frozen_quantizer: BlockQuantizer | None = None  # [Note: quantized frozen weights] in packed.py
    # [Note: units apart] in plan.py: module name -> the group its unit is sharded over (others: the world's)
    unit_groups: Mapping[str, Collectives] = field(default_factory=dict)


def build_units(
    module: nn.Module,
    groups: Sequence[ParamGroupSpec],
    policy: BuildPolicy,
    comm: Collectives,
    device: torch.device,
    gradients: GradientTier,
) -> BuiltUnits:
    persistence = (policy.persistence_threshold, policy.model_persistence_threshold)
    specs = plan_units(module, policy.unit_policy, *persistence, leaves=policy.leaves)
    group_of = {id(p): gi for gi, g in enumerate(groups) for _, p in g.params}
    unit_comms = [policy.unit_groups.get(spec.name, comm) for spec in specs]
    # outside the optimizer: still reduced when trainable, last of all when frozen ([Note: frozen parameters at
    # stage 3] in unit.py)
    untracked, frozen = len(groups), len(groups) + 1

    def group_number(param: nn.Parameter) -> int:
        trains = param.requires_grad and policy.keeps_gradients
        return group_of.get(id(param), untracked) if trains else frozen

    named = dict(module.named_parameters())
    # made real below from records, a module's init (one unit's init can make another's parameters real) or the
    # checkpoint: those not from the checkpoint are the ones ranks may disagree on ([Note: one start on every rank])
    replayed = {id(p) for p in named.values() if p.is_meta and not (policy.weights and policy.weights.covers(p))}
    number(named.values())  # DeepSpeed's ds_id, in this order: [Note: DeepSpeed's parameter attributes]
    modules = dict(module.named_modules())
    layouts: list[UnitLayout] = []
    for spec, unit_comm in zip(specs, unit_comms, strict=True):
        rows = [(n, named[n].numel(), group_number(named[n])) for n in spec.param_names]
        layouts.append(layout_unit(rows, unit_comm.world_size, frozen_group=frozen))
    sizes = [layout.trainable_shard_numel for layout in layouts]  # the masters' and optimizer state's extent
    alone = policy.persistent_alone and len(specs) > 1 and specs[-1].name == PERSISTENT  # planned last
    chunks = greedy_chunks(sizes[:-1] if alone else sizes, policy.sub_group_numel, close="after")
    # [Note: partial offload] splits the layers' sub-groups; the persistent one takes the last one's tier
    tiers = [policy.master_tier.for_sub_group(k, len(chunks)) for k in range(len(chunks))]
    chunks += [[len(sizes) - 1]] if alone else []
    tiers += tiers[-1:] if alone else []
    chunk_of = {index: k for k, members in enumerate(chunks) for index in members}
    store = policy.master_tier.residency
    built = BuiltUnits([], [[] for _ in groups], [SubGroup(f"subgroup{k}", [], tiers[k]) for k in range(len(chunks))])
    for index, (spec, layout) in enumerate(zip(specs, layouts, strict=True)):
        params = [named[n] for n in spec.param_names]
        fill = _fill_from(policy.weights, params, layout, device)
        if fill is None:
            initialise(modules, spec.param_names, params, device, index)
            # values a GatheredParameters block set before initialize win over the checkpoint's
            load_parameters([p for p in params if not BUILT.kept(p)], policy.weights)
            if policy.init_source is not None:  # [Note: one start on every rank] in loading/agree.py
                agreed = [p.data for p in params if id(p) in replayed]
                comm.broadcast_coalesced(agreed, src=policy.init_source, label="zero_init start")
        unit = ShardedUnit(
            index,
            spec.name,
            None if spec.name == PERSISTENT else modules[spec.name],
            layout,
            params,
            unit_comms[index],
            policy.compute_dtype,
            policy.grad_dtype,
            device,
            tiers[chunk_of[index]],
            policy.param_tier,
            fill,
            policy.keeps_gradients,
            policy.master_dtype,
            policy.frozen_quantizer,
        )
        unit.release()
        grads = gradients.part_for(unit.grad_key, tiers[chunk_of[index]])
        unit.grad_copy = grads.copy_for(unit.grad_shard, unit.master) if unit.trainable else None
        unit.grad_transient = bool(unit.trainable) and not grads.holds_shards
        built.units.append(unit)
        built.sub_groups[chunk_of[index]].units.append(unit)
        for group, begin, end in layout.group_pieces(unit.shard_rank):
            if group < len(groups):
                master, grad = unit.master.narrow(0, begin, end - begin), unit.grad_shard.narrow(0, begin, end - begin)
                built.pieces[group].append(Piece(unit, master, grad))
        unit.place_shard()
        # NVMe: each master goes to disk as soon as it exists (the optimizer state follows after a step)
        store.place(built.sub_groups[chunk_of[index]].key, unit.separate_master())
        grads.place(GradShard(unit.grad_key, unit.grad_shard, bool(unit.trainable)))
        unit.zero_grad_shard()
    if replayed:  # buffers a module's init drew as its unit was built, or from the process's generator
        src = policy.init_source if policy.init_source is not None else comm.global_rank(0)
        comm.broadcast_coalesced(list(module.buffers()), src=src, label="zero_init start")
    if policy.frozen_quantizer is not None and comm.rank == 0:
        _log_packed(built.units)
    return built


def _log_packed(units: list[ShardedUnit]) -> None:
    """How much of this rank's shards zero_quantized_nontrainable_weights packed ([Note: quantized frozen weights])."""
    packed = [u for u in units if u.tail is not None]
    elements = sum(u.tail.numel for u in packed if u.tail is not None)
    total = sum(u.layout.shard_numel for u in units)
    logger.info(
        "zero_quantized_nontrainable_weights: %d of %d units hold frozen weights as int8 blocks, %d of this rank's "
        "%d shard elements (%.0f%%); the rest stay in the compute dtype (trainable, or in the persistent unit)",
        len(packed),
        len(units),
        elements,
        total,
        100.0 * elements / max(total, 1),
    )


def _fill_from(
    weights: StreamedWeights | None,
    params: list[nn.Parameter],
    layout: UnitLayout,
    device: torch.device,
) -> Callable[[torch.Tensor, int, int], None] | None:
    """For a unit the checkpoint covers whole: the read of a range of its flat buffer from the file, its parameters
    given untouched storage (never written: the shard is read directly). None: initialise, then load what it has."""
    if weights is None or not all(weights.covers(p) and not BUILT.kept(p) for p in params):
        return None
    for p in params:
        if p.is_meta:
            make_real(p, device)
    slots = [(params[s.index], s.offset, s.numel) for s in layout.slots]
    return lambda out, lo, hi: weights.read_flat(slots, out, lo, hi)
