"""`deepspeed.utils`'s ZeRO-3 leaf-module functions: mark modules that stage 3 (and the fsdp2 backend) gather whole
([Note: leaf modules] in zero/stage3/plan.py). Call them before `initialize`, which plans the units.

The mark is DeepSpeed's: a `_z3_leaf` attribute on the module, which scripts and libraries (ms-swift, for its
mixture-of-experts models) set through these functions and read back with `z3_leaf_module`. The modules the
`zero_optimization.leaf_module` block names are marked too when a stage-3 (or fsdp2) engine is built, as DeepSpeed's
engine marks them.

Example:
    >>> from torch import nn
    >>> from zeroshard.utils import get_z3_leaf_modules, set_z3_leaf_modules
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)]))
    >>> [type(m).__name__ for m in set_z3_leaf_modules(model, [nn.ModuleList])]
    ['ModuleList']
    >>> len(get_z3_leaf_modules(model))
    1
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import nn


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` itself is marked as a leaf."""
    return bool(getattr(model, "_z3_leaf", False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The marked modules of `model` (itself included), in `modules()` order."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (or unmark) `model` itself."""
    vars(model)["_z3_leaf"] = flag  # DeepSpeed's mark (a plain attribute), which its users read back


def _class_matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _applied(module: nn.Module) -> Iterator[nn.Module]:
    """The modules `module.apply` visits, in its order (children first; a shared module once per path), which is
    the order DeepSpeed returns the marked modules in."""
    for child in module.children():
        yield from _applied(child)
    yield module


def _set_by_class(
    model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    if not all(isinstance(c, type | str) for c in classes):
        raise TypeError(f"leaf_module_classes must be a list of types or class names, got {classes!r}")
    matched = [m for m in _applied(model) if any(_class_matches(m, c) for c in classes)]
    for module in matched:
        set_z3_leaf_module(module, flag)
    if not matched and raise_if_not_found:
        raise ValueError(f"no modules of type {list(classes)} found in model {type(model).__name__}")
    return matched


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module of `model` that is an instance of one of `leaf_module_classes` (a type matches subclasses
    too; a string is a class name or its module-qualified name); the marked modules, children before parents (the
    order of `model.apply`)."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Unmark the modules `set_z3_leaf_modules` would mark."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules named (as in `named_modules()`); (marked modules, names that matched none)."""
    modules = dict(model.named_modules())
    matched = [modules[name] for name in module_names if name in modules]
    missing = [name for name in module_names if name not in modules]
    for module in matched:
        set_z3_leaf_module(module, flag)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing} found in model {type(model).__name__}")
    return matched, missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose qualified name ends with one of the suffixes; (marked modules, suffixes that matched
    none). A module is listed once however many suffixes match it."""
    named = list(model.named_modules())
    matched: dict[int, nn.Module] = {}
    missing: list[str] = []
    for suffix in module_name_suffixes:
        hits = [module for name, module in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for module in hits:
            set_z3_leaf_module(module, flag)
            matched.setdefault(id(module), module)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules matching suffixes {missing} found in model {type(model).__name__}")
    return list(matched.values()), missing
