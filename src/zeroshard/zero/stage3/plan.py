"""Which parameters form which unit, and where they sit in the unit's flat buffer. Pure functions.

[Note: units]
A unit is gathered with one collective. By default every transformer block is a unit (the classes a
Hugging Face model lists in `_no_split_modules`, otherwise the children of a ModuleList/Sequential
whose class repeats), and the root module is the unit of every parameter no block owns (embeddings,
final norm, head). A parameter shared by modules of different units (tied weights) belongs to their
closest common ancestor unit, which is gathered for as long as both run. Parameters with at most
`stage3_param_persistence_threshold` elements (DeepSpeed's `<=`) are moved to one persistent unit that stays gathered
on every rank (it is still sharded for the optimizer and re-gathered once after each step), as long as the
persistent parameters, taken in registration order, stay within `stage3_model_persistence_threshold` elements.

[Note: leaf modules]
A leaf module (DeepSpeed's ZeRO-3 leaf: `zero_optimization.leaf_module`, or `deepspeed.utils.set_z3_leaf_modules`)
is gathered whole: no unit is made inside it. One that lies inside a unit already is (it stays there); one outside
every unit becomes a unit of its own. This is what a module whose children run for some inputs only needs, a
mixture-of-experts block that skips experts no token was routed to: with each expert a unit, ranks whose tokens
went to different experts would gather different units (a `CollectiveMismatchError`); with the block a leaf, every
rank gathers the block and an expert left out on one rank gets a zero gradient there.

[Note: units apart]
Some modules hold parameters that are sharded over a group other than the world's: MoE experts with ep_size > 1
over their expert-data-parallel group ([Note: experts at stage 3] in moe/stage3.py). Such a module is a unit of
its own wherever it lies (inside a block, inside a leaf), gathered whole (no unit is made inside it), and its
parameters are never persistent (the persistent unit is sharded over the world). `LeafModules.apart` names them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

UnitPolicy = Callable[[str, nn.Module], bool]
PERSISTENT = "<persistent>"


@dataclass(frozen=True)
class UnitSpec:
    name: str  # the module's qualified name ("" for the root) or PERSISTENT
    param_names: tuple[str, ...]


def default_unit_policy(root: nn.Module) -> UnitPolicy:
    """Transformer blocks: HF `_no_split_modules` classes, else repeated children of module lists. A unit is gathered
    when its forward runs, so a child without a forward of its own (a `ModuleList` or `ModuleDict` whose modules the
    parent calls directly, as in DeepSpeed's `TiledLinear` rows) is looked into, never made a unit: its unit would
    never be gathered and the first forward would read empty shards."""
    no_split = set(getattr(root, "_no_split_modules", None) or [])
    repeated: set[int] = set()

    def visit(module: nn.Module) -> None:
        if isinstance(module, nn.ModuleList | nn.Sequential):
            kinds = [type(c) for c in module.children()]
            for child in module.children():
                composite = any(True for _ in child.children())  # a block, not a bare Linear
                called = type(child).forward is not nn.Module.forward
                if kinds.count(type(child)) >= 2 and composite and called and any(True for _ in child.parameters()):
                    repeated.add(id(child))
        for child in module.children():
            if id(child) not in repeated:  # outermost repeated blocks only
                visit(child)

    visit(root)

    def policy(name: str, module: nn.Module) -> bool:
        return type(module).__name__ in no_split if no_split else id(module) in repeated

    return policy


@dataclass(frozen=True)
class LeafModules:
    """Which modules are gathered whole ([Note: leaf modules]): those flagged by `set_z3_leaf_modules` and those the
    `zero_optimization.leaf_module` block names, by class (its name or module-qualified name, as DeepSpeed matches
    strings), by qualified module name, or by a suffix of it."""

    classes: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    name_suffixes: tuple[str, ...] = ()
    apart: frozenset[str] = frozenset()  # [Note: units apart]: qualified names of modules that are units of their own

    def __call__(self, name: str, module: nn.Module) -> bool:
        if getattr(module, "_z3_leaf", False):
            return True
        cls = type(module)
        if cls.__name__ in self.classes or f"{cls.__module__}.{cls.__qualname__}" in self.classes:
            return True
        return name in self.names or any(name.endswith(s) for s in self.name_suffixes)  # "" matches all, as there

    def mark(self, root: nn.Module) -> None:
        """Set DeepSpeed's `_z3_leaf` mark on the modules of `root` the block names, as DeepSpeed's engine applies
        `zero_optimization.leaf_module` (so `z3_leaf_module` and `get_z3_leaf_modules` report them)."""
        for name, module in root.named_modules():
            if self(name, module):
                module._z3_leaf = True

    def unmatched(self, root: nn.Module) -> list[str]:
        """The names and suffixes that match no module of `root` (classes may name models not in use)."""
        names = [n for n, _ in root.named_modules()]
        missing = [n for n in self.names if n not in names]
        return missing + [s for s in self.name_suffixes if not any(n.endswith(s) for n in names)]


NO_LEAVES = LeafModules()


def _unit_of_module(root: nn.Module, policy: UnitPolicy | None, leaves: LeafModules) -> dict[str, str]:
    """Every module's name -> the name of the unit module it belongs to ("" for the root)."""
    wants_unit = policy or default_unit_policy(root)
    unit_of_module: dict[str, str] = {}
    whole: set[str] = set()  # leaf modules and everything inside them
    for name, module in root.named_modules():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        inherited = unit_of_module.get(parent, "") if name else ""
        if name in leaves.apart:  # [Note: units apart]
            unit_of_module[name] = name
            whole.add(name)
        elif name and parent in whole:
            unit_of_module[name] = inherited
            whole.add(name)
        elif leaves(name, module):
            unit_of_module[name] = inherited or name  # inside a unit already: gathered whole with it
            whole.add(name)
        else:
            unit_of_module[name] = name if name and wants_unit(name, module) else inherited
    return unit_of_module


def unit_module_names(root: nn.Module, policy: UnitPolicy | None, leaves: LeafModules = NO_LEAVES) -> list[str]:
    """The modules the policy makes units (blocks), in registration order, also those left without a unit of their
    own because every parameter is persistent: the per-step divergence digest follows them all."""
    return list(dict.fromkeys(n for n in _unit_of_module(root, policy, leaves).values() if n))


def plan_units(
    root: nn.Module,
    policy: UnitPolicy | None,
    persistence_threshold: int,
    model_persistence_threshold: int = sys.maxsize,
    leaves: LeafModules = NO_LEAVES,
) -> list[UnitSpec]:
    """Units in registration order (root first, persistent last); every parameter is in exactly one. A parameter
    of at most `persistence_threshold` elements is persistent while the persistent ones, in registration order, add up
    to at most `model_persistence_threshold` elements (DeepSpeed's stage3_model_persistence_threshold)."""
    unit_of_module = _unit_of_module(root, policy, leaves)

    owners: dict[int, list[str]] = {}
    first_name: dict[int, str] = {}
    for mod_name, module in root.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(mod_name)
            first_name.setdefault(id(param), f"{mod_name}.{p_name}" if mod_name else p_name)

    members: dict[str, list[str]] = {"": []}
    for name in unit_of_module.values():
        members.setdefault(name, [])
    persistent: list[str] = []
    persistent_numel = 0
    for name, param in root.named_parameters():
        units = {unit_of_module[m] for m in owners[id(param)]}
        unit = units.pop() if len(units) == 1 else _common_ancestor([unit_of_module[m] for m in owners[id(param)]])
        small = param.numel() <= persistence_threshold and unit not in leaves.apart  # [Note: units apart]
        if small and persistent_numel + param.numel() <= model_persistence_threshold:
            persistent.append(name)
            persistent_numel += param.numel()
        else:
            members[unit].append(name)
    specs = [UnitSpec(name, tuple(params)) for name, params in members.items() if params]
    if persistent:
        specs.append(UnitSpec(PERSISTENT, tuple(persistent)))
    return specs


def root_entries(
    root: nn.Module, policy: UnitPolicy | None, param_names: Sequence[str], leaves: LeafModules = NO_LEAVES
) -> list[str] | None:
    """The modules whose forward uses the root unit's parameters `param_names` ([Note: root unit by module] in
    root.py): the modules outside every block that own one directly, in registration order. None when one is the
    root's own or is shared with a module inside a block: then only the root's whole forward covers its uses."""
    if leaves("", root):  # the whole model is one leaf: gathered for its whole forward ([Note: leaf modules])
        return None
    unit_of_module = _unit_of_module(root, policy, leaves)
    wanted = set(param_names)
    entries: list[str] = []
    seen: set[int] = set()
    for mod_name, module in root.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen or (f"{mod_name}.{p_name}" if mod_name else p_name) in wanted:
                seen.add(id(param))
                if not mod_name or unit_of_module[mod_name]:
                    return None
                if mod_name not in entries:
                    entries.append(mod_name)
    return entries


def _common_ancestor(unit_names: Sequence[str]) -> str:
    parts = [n.split(".") if n else [] for n in unit_names]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    candidate = ".".join(common)
    # the ancestor must itself be a unit; the caller maps unknown names to the root
    return candidate if candidate in unit_names else ""


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int
    numel: int
    group: int
    index: int  # position in the unit's parameter list (slots are ordered by group, not by index)


@dataclass(frozen=True)
class UnitLayout:
    """A unit's flat buffer: parameters sorted by optimizer group, each start aligned; the trainable parameters and
    the frozen ones in two sections, each padded to N and split evenly over the ranks ([Note: frozen parameters at
    stage 3] in unit.py)."""

    numel: int
    shard_numel: int
    slots: tuple[Slot, ...]
    group_ranges: tuple[tuple[int, int, int], ...]  # (group, begin, end) in the flat buffer
    trainable_end: int = 0  # the trainable parameters' end
    frozen_start: int = -1  # where the frozen parameters' section begins; -1: there is none

    @property
    def shard_count(self) -> int:
        return self.numel // self.shard_numel

    @property
    def sections(self) -> tuple[tuple[int, int], ...]:
        """(flat start, elements per rank) of each non-empty section: the trainable one, then the frozen one. Rank r
        holds the r-th chunk of each, in that order, as its shard."""
        frozen = self.numel if self.frozen_start < 0 else self.frozen_start
        width = frozen // self.shard_count
        return tuple((start, w) for start, w in ((0, width), (frozen, self.shard_numel - width)) if w)

    @property
    def trainable_extent(self) -> int:
        """Elements of the flat buffer from its start that hold every trainable parameter: the trainable section, or
        the whole buffer in a unit of one section (what backward stages and reduce-scatters)."""
        return self.frozen_start if self.frozen_width else self.numel

    @property
    def frozen_width(self) -> int:
        """Elements of the frozen section in each rank's shard: the end of the shard."""
        return 0 if self.frozen_start < 0 else self.shard_numel - self.frozen_start // self.shard_count

    @property
    def trainable_shard_numel(self) -> int:
        """The prefix of every rank's shard that holds all of its trainable elements (its chunk of the trainable
        section): the length of its master, its gradient shard, and of each rank's part of the gradient
        reduce-scatter."""
        sections = self.sections
        return sections[0][1] if len(sections) > 1 else min(self.shard_numel, self.trainable_end)

    def shard_ranges(self, shard_rank: int) -> list[tuple[int, int, int]]:
        """(flat begin, flat end, offset in the shard) of each part of the buffer `shard_rank` holds."""
        out, at = [], 0
        for start, width in self.sections:
            begin = start + shard_rank * width
            out.append((begin, begin + width, at))
            at += width
        return out

    def owned_parts(self, shard_rank: int, begin: int, end: int) -> list[tuple[int, int, int]]:
        """(flat begin, flat end, offset in the shard) of the elements of [begin, end) that `shard_rank` holds."""
        out = []
        for lo, hi, at in self.shard_ranges(shard_rank):
            b, e = max(lo, begin), min(hi, end)
            if b < e:
                out.append((b, e, b - lo + at))
        return out

    def split(self, flat: torch.Tensor, parts: int | None = None) -> list[tuple[torch.Tensor, int]]:
        """`flat` (the unit's whole buffer, or one of the same length) as each section's [parts, chunk] view (parts:
        the shard count, or an hpZ group's size), with where a part's chunk of it starts in a part's own buffer."""
        parts = parts or self.shard_count
        out, at = [], 0
        for start, width in self.sections:
            chunk = width * self.shard_count // parts
            out.append((flat.narrow(0, start, chunk * parts).view(parts, chunk), at))
            at += chunk
        return out

    def take(self, flat: torch.Tensor, shard_rank: int) -> torch.Tensor:
        """`shard_rank`'s shard of `flat` (a view when it is one range, else a copy)."""
        pieces = [flat[b:e] for b, e, _ in self.shard_ranges(shard_rank)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def group_pieces(self, shard_rank: int) -> list[tuple[int, int, int]]:
        """(group, begin, end) of the owned ranges that fall in each group, as offsets in the shard."""
        return [
            (group, at, at + e - b)
            for group, begin, end in self.group_ranges
            for b, e, at in self.owned_parts(shard_rank, begin, end)
        ]


def layout_unit(
    params: Sequence[tuple[str, int, int]], shard_count: int, align: int = 16, frozen_group: int | None = None
) -> UnitLayout:
    """`params` are (name, numel, group) in registration order; `frozen_group` is the (largest) group number of the
    parameters that get no gradient: they form a section of their own after the others'."""
    if frozen_group is not None and any(group > frozen_group for _, _, group in params):
        raise ValueError(f"the frozen group {frozen_group} must be the largest group number")
    ordered = sorted(range(len(params)), key=lambda i: (params[i][2], i))
    slots: list[Slot] = []
    ranges: list[tuple[int, int, int]] = []
    offset, frozen_start, quantum = 0, -1, shard_count * align
    for i in ordered:
        name, numel, group = params[i]
        if group == frozen_group and frozen_start < 0:  # the frozen section starts on a multiple of N
            offset = frozen_start = -(-offset // quantum) * quantum
        if ranges and ranges[-1][0] == group:
            ranges[-1] = (group, ranges[-1][1], offset + numel)
        else:
            ranges.append((group, offset, offset + numel))
        slots.append(Slot(name, offset, numel, group, i))
        offset = -(-(offset + numel) // align) * align
    padded = -(-max(offset, 1) // quantum) * quantum
    # a group's range ends at its last element; padding after it belongs to no group
    trainable_end = max((end for group, _, end in ranges if group != frozen_group), default=0)
    return UnitLayout(padded, padded // shard_count, tuple(slots), tuple(ranges), trainable_end, frozen_start)
