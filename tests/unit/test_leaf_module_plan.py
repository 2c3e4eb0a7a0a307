"""ZeRO-3 leaf modules ([Note: leaf modules]): DeepSpeed's marking functions compared with DeepSpeed 0.19.8's, and
the unit plan they and `zero_optimization.leaf_module` produce. No process group: training with them is in
tests/distributed/test_leaf_modules.py."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.zero.stage3.plan import NO_LEAVES, PERSISTENT, LeafModules, plan_units, root_entries, unit_module_names

NAMES = [
    "z3_leaf_module",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
]


class Expert(nn.Module):
    def __init__(self, d: int = 4):
        super().__init__()
        self.w1 = nn.Linear(d, 2 * d)
        self.w2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # called, so a unit candidate (a module the parent only
        return self.w2(self.w1(x))  # looks into is never gathered by itself)


class SparseMoe(nn.Module):
    def __init__(self, experts: int = 3):
        super().__init__()
        self.gate = nn.Linear(4, experts)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.moe = SparseMoe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


class Net(nn.Module):
    """An embedding, a top-level MoE block whose experts are the only repeated blocks (so each would be a unit), and
    two blocks that hold MoE blocks of their own."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.moe = SparseMoe()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(4, 8)


def _names(model: nn.Module, modules: list[nn.Module]) -> list[str]:
    by_id = {id(m): n for n, m in model.named_modules()}
    return [by_id[id(m)] for m in modules]


@pytest.mark.parametrize("name", NAMES)
def test_signatures_are_deepspeeds(name: str) -> None:
    import zeroshard.utils

    theirs = getattr(import_deepspeed("deepspeed.utils"), name)
    ours = inspect.signature(getattr(zeroshard.utils, name)).parameters
    assert list(ours) == list(inspect.signature(theirs).parameters)
    assert [p.default for p in ours.values()] == [p.default for p in inspect.signature(theirs).parameters.values()]


def _marking(fns: Any) -> list:
    """What `fns` (zeroshard.utils or deepspeed.utils) marks and returns, by module name, for a set of calls."""
    results: list = []
    for classes in ([SparseMoe], ["Expert"], [f"{__name__}.Block"], [nn.Linear, "SparseMoe"]):
        model = Net()
        marked = fns.set_z3_leaf_modules(model, classes)
        results.append((_names(model, marked), _names(model, fns.get_z3_leaf_modules(model))))
        fns.unset_z3_leaf_modules(model, classes)
        results.append(_names(model, fns.get_z3_leaf_modules(model)))
    model = Net()
    marked, missing = fns.set_z3_leaf_modules_by_name(model, ["moe", "blocks.1.moe.gate", "nope"], True, False)
    results.append((_names(model, marked), missing))
    marked, missing = fns.set_z3_leaf_modules_by_suffix(model, ["moe", "w2", "nope"], True, False)
    results.append((_names(model, marked), missing, _names(model, fns.get_z3_leaf_modules(model))))
    fns.set_z3_leaf_module(model.head, True)
    results.append((fns.z3_leaf_module(model.head), fns.z3_leaf_module(model.emb)))
    with pytest.raises(ValueError):
        fns.set_z3_leaf_modules(Net(), [nn.Conv1d])
    with pytest.raises(ValueError):
        fns.set_z3_leaf_modules_by_name(Net(), ["nope"])
    with pytest.raises(ValueError):
        fns.set_z3_leaf_modules_by_suffix(Net(), ["nope"])
    return results


def test_marking_matches_deepspeed() -> None:
    """Same modules marked and returned (in the same order) by class, class name, qualified class name, module name
    and suffix; unmarking; and the not-found errors."""
    import zeroshard.utils

    ours = _marking(zeroshard.utils)
    assert ours == _marking(import_deepspeed("deepspeed.utils"))
    assert ours[0] == (["moe", "blocks.0.moe", "blocks.1.moe"], ["moe", "blocks.0.moe", "blocks.1.moe"])


def _units(model: nn.Module, leaves: LeafModules = NO_LEAVES) -> dict[str, int]:
    return {spec.name: len(spec.param_names) for spec in plan_units(model, None, 0, leaves=leaves)}


def test_a_leaf_outside_every_unit_becomes_one_unit() -> None:
    model = Net()
    units = _units(model)
    assert {"moe.experts.0", "moe.experts.1", "moe.experts.2", "blocks.0", "blocks.1"} <= set(units)
    for leaves in (
        LeafModules(classes=("SparseMoe",)),
        LeafModules(names=("moe",)),
        LeafModules(name_suffixes=("oe",)),
    ):
        units = _units(model, leaves)
        assert sorted(units) == ["", "blocks.0", "blocks.1", "moe"], leaves
        assert units["moe"] == 2 + 3 * 4  # the gate and every expert's four tensors, in one unit
        assert units["blocks.0"] == 2 + 2 + 3 * 4  # a leaf inside a unit stays in it
    from zeroshard.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, [SparseMoe])  # DeepSpeed's mark plans the same units
    assert sorted(_units(model)) == ["", "blocks.0", "blocks.1", "moe"]
    assert unit_module_names(model, None) == ["moe", "blocks.0", "blocks.1"]


def test_a_leaf_makes_no_unit_inside_it_and_keeps_persistence() -> None:
    model = Net()
    leaves = LeafModules(classes=(f"{__name__}.Block", "SparseMoe"))
    specs = {s.name: s.param_names for s in plan_units(model, None, 10, leaves=leaves)}
    assert sorted(specs) == ["", PERSISTENT, "blocks.0", "blocks.1", "moe"]
    assert "moe.gate.weight" in specs["moe"] and not any(n.endswith("bias") for n in specs["moe"])  # < 10: persistent
    root_leaf = LeafModules(names=("",))
    assert [s.name for s in plan_units(model, None, 0, leaves=root_leaf)] == [""]  # the whole model, one unit
    names = [n for n, _ in model.named_parameters()]
    assert root_entries(model, None, names, root_leaf) is None  # gathered for the root's whole forward
    assert root_entries(model, None, ["emb.weight", "head.weight"]) == ["emb", "head"]


def test_unmatched_names_and_suffixes_are_reported() -> None:
    leaves = LeafModules(classes=("MixtralSparseMoeBlock",), names=("moe", "mo"), name_suffixes=("gate", "xyz"))
    assert leaves.unmatched(Net()) == ["mo", "xyz"]
    assert leaves("moe", Net().moe) and not leaves("emb", nn.Embedding(2, 2))
