"""`fully_shard` applied on zeroshard's units, and the few FSDP2 module calls the strategy makes on them.

[Note: fsdp2 units]
The units are those of zeroshard's stage 3 ([Note: units]): every block the unit policy names gets its own
`fully_shard` (innermost first, as FSDP2 requires), then the root takes every parameter no block owns (embeddings,
final norm, head, tied weights). FSDP2 has no persistent unit: `stage3_param_persistence_threshold` does not
apply. Gathering a unit for a block (`gathered()`, `GatheredParameters`) is FSDP2's own `unshard()` with
`reshard_after_forward` switched off meanwhile, so a forward inside the block (generation) does not release it.

FSDP2's private state is read in this file only: the unsharded tensors of a gathered unit (`FSDPParam.
unsharded_param`, to broadcast a modification under `modifier_rank`), and each parameter group's
`post_forward_mesh_info` (what `set_reshard_after_forward` sets), saved and restored around a gathered block
because the public setter cannot restore the root's special "not after forward" default.

A parameter that got no gradient on this rank is reduced as zeros (`set_reduce_scatter_unused_params`), as the zero
backend's flat shards do: FSDP2 otherwise reduce-scatters only the parameters with a gradient, so ranks whose tokens
reached different experts of a leaf module ([Note: leaf modules]) would sum different parameters' gradients into one
another without an error. A torch whose FSDP2 lacks that setter is refused when the model has a leaf module.

[Note: parameter attributes under fsdp2]
`fully_shard` replaces every parameter by new objects (the sharded DTensor parameter, and at the first gather the
unsharded one), which carry none of the Python attributes set on the original: mup's `infshape`, which its
`MuReadout` reads in every forward, a `use_muon` tag, a model's own marks. Each attribute of an original
parameter is set on its sharded parameter after `fully_shard`, and on its unsharded parameter by a forward
pre-hook on its unit (after FSDP2's own, which gathers it; the object is made once and reused), so the module
sees the attributes whether its parameter is sharded or gathered.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ConfigError
from zeroshard.fsdp2.comms import CountedAllGather, CountedReduceScatter
from zeroshard.fsdp2.plan import Fsdp2Plan
from zeroshard.zero.stage3.plan import LeafModules, UnitPolicy, unit_module_names


@dataclass(frozen=True)
class Fsdp2Unit:
    """One `fully_shard`ed module and the names (in the root's namespace) of the parameters it owns."""

    name: str  # "" for the root
    module: FSDPModule
    param_names: tuple[str, ...]


def shard_units(
    root: nn.Module,
    plan: Fsdp2Plan,
    units: tuple[UnitPolicy | None, LeafModules],
    comm: Collectives,
    device: torch.device,
    divide_factor: float,
    mesh: DeviceMesh | None = None,
) -> list[Fsdp2Unit]:
    """`fully_shard` every unit, root last ([Note: fsdp2 units]); gradients are summed then divided by
    `divide_factor` ([Note: fsdp2 mapping]); `units`: the unit policy and the leaf modules ([Note: units]).
    `mesh`: the data-parallel dimension of a dp x tp mesh (torch's 2-D composition: [Note: tensor parallelism on
    fsdp2] in tp/fsdp2.py); else one over `comm`'s group."""
    if mesh is None:
        group = comm.group if comm.group is not None else dist.group.WORLD
        assert group is not None, "torch.distributed is not initialised"
        mesh = DeviceMesh.from_group(group, device.type)
    mixed = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    # pinning needs an accelerator (a CPU-only run "offloads" to where it already is)
    pin = plan.pin_memory and device.type != "cpu"
    offload = CPUOffloadPolicy(pin_memory=pin) if plan.cpu_offload else OffloadPolicy()
    modules = dict(root.named_modules())
    names = [n for n in unit_module_names(root, *units) if any(True for _ in modules[n].parameters())]
    # by name, since fully_shard replaces the parameter objects; the innermost unit holding a parameter owns it
    param_names = {id(p): n for n, p in root.named_parameters()}
    owner = dict.fromkeys(param_names.values(), "")
    for name in sorted(names, key=lambda n: n.count(".")):  # outermost first: inner units overwrite
        inside = {id(p) for p in modules[name].parameters()}
        for n, p in root.named_parameters(remove_duplicate=False):
            if id(p) in inside and n.startswith(name + "."):
                owner[param_names[id(p)]] = name
    attributes = _parameter_attributes(root)  # [Note: parameter attributes under fsdp2]
    for name in sorted(names, key=lambda n: n.count("."), reverse=True):  # innermost first
        fully_shard(
            modules[name],
            mesh=mesh,
            reshard_after_forward=plan.reshard_after_forward,
            mp_policy=mixed,
            offload_policy=offload,
        )
    fully_shard(
        root, mesh=mesh, reshard_after_forward=plan.reshard_after_forward, mp_policy=mixed, offload_policy=offload
    )
    zero_unused = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
    if not zero_unused and any(units[1](n, m) for n, m in root.named_modules()):
        raise ConfigError(
            f"the model has ZeRO-3 leaf modules (zero_optimization.leaf_module), whose parameters may get gradients "
            f"on some ranks only, and torch {torch.__version__}'s FSDP2 cannot reduce the missing ones as zeros "
            '(FSDPModule.set_reduce_scatter_unused_params): use a newer torch, or zeroshard.backend "zero"'
        )
    sharded = []
    for name in [*names, ""]:
        module = modules[name] if name else root
        assert isinstance(module, FSDPModule)
        if zero_unused:
            module.set_reduce_scatter_unused_params(True, recurse=False)
        module.set_gradient_divide_factor(divide_factor)
        module.set_force_sum_reduction_for_comms(True)
        module.set_custom_all_gather(CountedAllGather(comm))
        module.set_custom_reduce_scatter(CountedReduceScatter(comm))
        owned = tuple(n for n, o in owner.items() if o == name)
        sharded.append(Fsdp2Unit(name, module, owned))
        _carry_attributes(module, attributes)
    return sharded


# what FSDP2's parameters carry of their own (nothing to copy over them)
_OWN_ATTRIBUTES = frozenset(vars(nn.Parameter(torch.zeros(1))))


def _parameter_attributes(root: nn.Module) -> dict[tuple[int, str], dict[str, object]]:
    """The Python attributes of each parameter that has some, by (id of its module, its name there)."""
    found = {}
    for module in root.modules():
        for name, param in module.named_parameters(recurse=False):
            extra = {k: v for k, v in vars(param).items() if k not in _OWN_ATTRIBUTES}
            if extra:
                found[(id(module), name)] = extra
    return found


def _carry_attributes(unit: FSDPModule, attributes: dict[tuple[int, str], dict[str, object]]) -> None:
    """[Note: parameter attributes under fsdp2]: the unit's sharded parameters get their originals' attributes
    now, the unsharded ones at each forward (set once: later forwards find them there)."""
    carried = []
    for group in unit._get_fsdp_state()._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            info = fsdp_param._module_info
            extra = attributes.get((id(info.module), info.param_name))
            if extra:
                _set_missing(fsdp_param.sharded_param, extra)
                carried.append((fsdp_param, extra))
    if not carried:
        return

    def to_unsharded(module: nn.Module, args: object) -> None:
        for fsdp_param, extra in carried:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                _set_missing(unsharded, extra)

    assert isinstance(unit, nn.Module)
    unit.register_forward_pre_hook(to_unsharded)


def _set_missing(param: nn.Parameter, extra: dict[str, object]) -> None:
    for key, value in extra.items():
        if not hasattr(param, key):
            setattr(param, key, value)


def unsharded_views(unit: Fsdp2Unit) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(sharded parameter, full tensor) of each parameter of a gathered unit ([Note: fsdp2 units])."""
    state = unit.module._get_fsdp_state()
    return [(p.sharded_param, p.unsharded_param) for group in state._fsdp_param_groups for p in group.fsdp_params]


@contextmanager
def held_gathered(units: Sequence[Fsdp2Unit]) -> Iterator[None]:
    """`units` unsharded for the block (collective), released after it ([Note: fsdp2 units])."""
    saved = []
    for unit in units:
        unit.module.unshard()
        for group in unit.module._get_fsdp_state()._fsdp_param_groups:
            saved.append((group, group.post_forward_mesh_info))
            group.post_forward_mesh_info = None  # a forward inside the block keeps the unit gathered
    try:
        yield
    finally:
        for group, info in saved:
            group.post_forward_mesh_info = info
        for unit in units:
            unit.module.reshard()
