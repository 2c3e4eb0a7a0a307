"""transformers' checkpoint conversions (renamed keys, experts fused from per-expert tensors) in a streaming load.

[Note: converted checkpoints in a streaming load]
transformers 5 holds the experts of a mixture-of-experts model fused (Qwen3-MoE's `mlp.experts.gate_up_proj`, one
[experts, 2 x intermediate, hidden] tensor) while its checkpoints store each expert apart (`mlp.experts.3.gate_proj
.weight`); its `from_pretrained` renames and fuses them with a conversion mapping per model type
(`conversion_mapping.py`: Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE, GLM-4-MoE and the others mapped to them), so a
streaming load that read tensors as stored found none of the experts. The mapping's two usual operations only place
whole source tensors one after another: `MergeModulelist(dim=0)` stacks a pattern's tensors (natural key order, as
transformers sorts them) and `Concatenate(dim=d)` joins the stacked tensors along d. Either way each element of the
fused tensor is one element of one source, and the fused tensor's flat (row-major) elements are runs of consecutive
elements of the sources: for [E, I, H] gate and up joined along 1, gate_e's I x H elements then up_e's, for each e.
So a fused tensor is a `Composite`: its shape and its runs (source key, first element, count), and a rank reads the
part of it that it keeps run by run, as it reads any tensor ([Note: streaming load]); nothing is fused in memory and
the fused tensor never exists whole on any rank. Keys are renamed with transformers' own `rename_source_key` over the
model's own `get_model_conversion_mapping` (its renamings, then at most one converter), so the names are
transformers' exactly. A converter with any other operation (a transpose, a split, a permutation, a dequantisation)
is not a placement: a checkpoint that needs one is refused in one line naming it, as before; so is one whose
experts are numbered with a gap (stacking would shift the later ones, which transformers does not notice).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

Run = tuple[str, int, int]  # (checkpoint key, first element, elements)


@dataclass(frozen=True)
class Composite:
    """A model tensor whose flat elements are `runs` of checkpoint tensors' flat elements, in order."""

    shape: tuple[int, ...]
    runs: tuple[Run, ...]
    starts: tuple[int, ...] = field(default=())  # each run's first element in the composite

    @staticmethod
    def of(shape: tuple[int, ...], runs: Sequence[Run]) -> Composite:
        starts, at = [], 0
        for _, _, count in runs:
            starts.append(at)
            at += count
        return Composite(shape, tuple(runs), tuple(starts))

    @property
    def sources(self) -> list[str]:
        return list(dict.fromkeys(key for key, _, _ in self.runs))

    def pieces(self, start: int, stop: int) -> list[tuple[str, int, int, int]]:
        """(source key, its first element, its stop, offset in [start, stop)) covering elements [start, stop)."""
        out = []
        k = max(0, bisect.bisect_right(self.starts, start) - 1)
        while k < len(self.runs) and self.starts[k] < stop:
            key, first, count = self.runs[k]
            lo, hi = max(start, self.starts[k]), min(stop, self.starts[k] + count)
            if lo < hi:
                out.append((key, first + lo - self.starts[k], first + hi - self.starts[k], lo - start))
            k += 1
        return out


@dataclass
class Conversions:
    """The model-facing names of a checkpoint's tensors: renamed ones (model key -> checkpoint key), fused ones, and
    the targets a converter would build with operations a streaming load does not do (target -> their names)."""

    renamed: dict[str, str] = field(default_factory=dict)
    composites: dict[str, Composite] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)

    @property
    def consumed(self) -> set[str]:
        used = set(self.renamed.values())
        for composite in self.composites.values():
            used.update(composite.sources)
        return used


@dataclass
class _Virtual:
    shape: tuple[int, ...]
    runs: list[Run]


def plan_conversions(model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> Conversions:
    """Conversions of the checkpoint keys `shapes` (key -> shape) for `model`, by transformers' mapping."""
    out = Conversions()
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # transformers 4.x: checkpoints hold what the model holds
        return out
    if not hasattr(model, "config"):
        return out
    transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    groups: dict[tuple[int, str], dict[str, list[str]]] = {}
    for key in sorted(shapes, key=dot_natural_key):  # transformers stacks experts in this order
        target, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            if target != key:
                out.renamed[target] = key
            continue
        index = next(i for i, c in enumerate(converters) if pattern in c.source_patterns)
        groups.setdefault((index, target), {}).setdefault(pattern, []).append(key)
    for (index, target), by_pattern in groups.items():
        converter = converters[index]
        gap = _numbering_gap(by_pattern)
        built = gap or _compose(converter.operations, converter.source_patterns, by_pattern, shapes)
        if isinstance(built, str):
            out.unsupported[target] = built
            continue
        out.composites[target] = Composite.of(built.shape, built.runs)
    return out


def _numbering_gap(by_pattern: Mapping[str, list[str]]) -> str | None:
    """Stacking places the k-th stored expert at index k: the stored ones must be numbered 0..n-1 (a checkpoint
    holding experts 0, 1, 3, 4 of four would put expert 3 in slot 2, where transformers does not notice). The
    number is the one dot-separated field that differs between a pattern's keys (they share a layer), whatever way
    the pattern is written (glob or regular expression)."""
    for keys in by_pattern.values():
        fields = [key.split(".") for key in keys]
        if len(keys) < 2 or any(len(f) != len(fields[0]) for f in fields):
            continue
        varying = [i for i in range(len(fields[0])) if len({f[i] for f in fields}) > 1]
        if len(varying) != 1 or not all(f[varying[0]].isdigit() for f in fields):
            continue
        numbers = [int(f[varying[0]]) for f in fields]
        if numbers != list(range(len(keys))):
            return f"experts numbered {numbers} in the checkpoint (stacking needs 0..{len(keys) - 1})"
    return None


def _compose(
    operations: Sequence[Any],
    patterns: Sequence[str],
    by_pattern: Mapping[str, list[str]],
    shapes: Mapping[str, tuple[int, ...]],
) -> _Virtual | str:
    """The fused tensor's layout, or a description of the first operation that is not a placement."""
    lists = {p: [_Virtual(shapes[k], [(k, 0, math.prod(shapes[k]))]) for k in keys] for p, keys in by_pattern.items()}
    tensors: dict[str, _Virtual] | None = None
    for op in operations:
        name, dim = type(op).__name__, getattr(op, "dim", None)
        if name == "MergeModulelist" and dim == 0 and tensors is None:
            stacked = {p: _stack(items) for p, items in lists.items()}
            if any(v is None for v in stacked.values()):
                return "MergeModulelist over tensors of different shapes"
            tensors = {p: v for p, v in stacked.items() if v is not None}
        elif name == "Concatenate" and isinstance(dim, int) and tensors is not None:
            joined = _concatenate([tensors[p] for p in patterns if p in tensors], dim)
            if joined is None:
                return f"Concatenate(dim={dim}) over tensors of other shapes"
            tensors = {"": joined}
        else:
            return repr(op)
    if tensors is None or len(tensors) != 1:
        return "a conversion that leaves several tensors"
    return next(iter(tensors.values()))


def _stack(items: list[_Virtual]) -> _Virtual | None:
    if not items or any(v.shape != items[0].shape for v in items):
        return None
    return _Virtual((len(items), *items[0].shape), [run for v in items for run in v.runs])


def _concatenate(parts: list[_Virtual], dim: int) -> _Virtual | None:
    if not parts or not 0 <= dim < len(parts[0].shape):
        return None
    rest = [v.shape[:dim] + v.shape[dim + 1 :] for v in parts]
    if any(r != rest[0] for r in rest):
        return None
    outer = math.prod(parts[0].shape[:dim])
    blocks = [math.prod(v.shape[dim:]) for v in parts]
    cursors = [_Cursor(v.runs) for v in parts]
    runs: list[Run] = []
    for _ in range(outer):  # each part's next block in turn: O(runs) in all
        for cursor, block in zip(cursors, blocks, strict=True):
            runs += cursor.take(block)
    shape = (*parts[0].shape[:dim], sum(v.shape[dim] for v in parts), *parts[0].shape[dim + 1 :])
    return _Virtual(shape, runs)


class _Cursor:
    """Consecutive elements of the tensor `runs` describe, taken from the front."""

    def __init__(self, runs: list[Run]) -> None:
        self.runs, self.k, self.used = runs, 0, 0  # run index, elements of it already taken

    def take(self, count: int) -> list[Run]:
        out: list[Run] = []
        while count > 0:
            key, first, length = self.runs[self.k]
            n = min(count, length - self.used)
            out.append((key, first + self.used, n))
            count -= n
            self.used += n
            if self.used == length:
                self.k, self.used = self.k + 1, 0
        return out
