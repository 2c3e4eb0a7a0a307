"""What a model's code wrote into its meta tensors under `zero_init`, replayed for real when they are materialised.

[Note: initialisation recorded under zero_init]
Under `zero_init` a model is built on the meta device, where every value its code computes or writes is lost: a
custom norm's `nn.Parameter(torch.ones(d))`, a position table `nn.Parameter(torch.randn(n, d) * 0.02)`, a causal-mask
buffer, `nn.init.zeros_(self.out.weight)` in a parent's `__init__` (adaLN-Zero), `self.apply(self._init_weights)` with
a free function, GPT-2's scaled projections (`for n, p in self.named_parameters(): ... normal_(p, std=0.02 /
sqrt(2 * n_layer))`). `initialize` gave such tensors their modules' `reset_parameters()` values, or zeros where a
module had none (a custom LayerNorm's weight): the model trained from another initialisation than its code writes,
without a word. (DeepSpeed's `zero.Init` keeps what a module's own constructor computes, and gathers inside
`module.apply` (`override_module_apply`); a direct write to a built child's parameter is lost there.)

So while `zero_init` is active, a torch function mode (torch's public extension point; nothing is patched) records,
from the thread that entered it, for each meta storage made there: the call that created it, and each in-place call
that wrote into it or into a view of it (the view's size, stride and offset kept); meta tensors among a call's
arguments are kept as references to their storages at the version they had then (a later write does not change what
an earlier call read). `torch.nn.init` functions are recorded as one call each. At the block's end, each module's
meta parameters and buffers are bound to their storages' records (by the module, in a weak map: nothing is added to
the parameters). Materialising a module (`initialize`, unit by unit, and a `GatheredParameters` block before it)
replays its tensors' records, every event in the order it happened, under the unit's seed shared by all ranks:
creators run on the target device (a `device="meta"` argument becomes that device), writes go into views of their
results. The values follow the same distributions as the model built whole, not the same draws, and are the same on
every rank. Standard layers record exactly what their `reset_parameters()` does, in the same order, so their values
are bit-identical to before.

- A tensor whose record is not an initialisation (made by `torch.empty` and never written, as under transformers'
  skipped initialisation, or depending on a meta tensor made outside the block) keeps the module's own
  initialisation: `reset_parameters()` and the root's `_init_weights`.
- transformers skips `_init_weights` on the meta device (its `init_weights`) and runs it when a model is built
  whole: for a `PreTrainedModel` root, `_init_weights(module)` runs after the replay, as it would after construction.
- Not recorded: writes after the `zero_init` block (use `GatheredParameters(..., modifier_rank=0)` there, as with
  DeepSpeed); reading a meta value into Python (`.item()` fails on the meta device); a tensor derived from another
  module's parameter is computed anew from that parameter's record (the same distribution, not the same values).
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zeroshard.errors import ZeroshardError

# calls named like in-place ones that change no values (metadata, autograd, storage rebinding)
_NOT_WRITES = frozenset(
    {
        "requires_grad_", "share_memory_", "detach_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "t_",
        "transpose_", "swapdims_", "swapaxes_", "rename_", "resize_", "resize_as_", "record_stream",
    }
)  # fmt: skip
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
        "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
    }
)  # fmt: skip
_UNINITIALISED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
_SEQUENCE = itertools.count()  # events of every recording, in the order they happened


@dataclass(frozen=True)
class Geometry:
    """A view of a storage: what `as_strided` needs to take it again from a tensor over the whole storage."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> Geometry:
        return Geometry(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()), t.dtype)


@dataclass
class Call:
    """A recorded call: its arguments with meta tensors as `Ref`s, the meta device as `DEVICE`, and the tensor a
    write goes into as `TARGET`."""

    func: Callable[..., Any] | None  # None: not replayable (it read a meta tensor made outside the recording)
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        return str(getattr(self.func, "__name__", self.func))


@dataclass
class Write:
    sequence: int
    into: Geometry
    call: Call


@dataclass(eq=False)
class Record:
    """One meta storage's history: its creator (an output of `creator`, at `path`) and the writes into it."""

    creator: Call
    path: tuple[int, ...]
    sequence: int
    made: Geometry
    writes: list[Write] = field(default_factory=list)
    read_at: set[int] = field(default_factory=set)  # versions other calls read: kept while a replay advances

    def initialises(self, version: int | None = None) -> bool:
        """Whether the storage holds values at `version` (its last by default) that the replay can compute: not made by
        `torch.empty` (or from such a storage) without a write since."""
        writes = self.writes if version is None else self.writes[:version]
        if self.creator.func is None or any(w.call.func is None for w in writes):
            return False
        if writes:
            return True
        refs = [r for r in _leaves((self.creator.args, self.creator.kwargs)) if isinstance(r, Ref)]
        return self.creator.name not in _UNINITIALISED and all(r.record.initialises(r.version) for r in refs)


@dataclass(frozen=True)
class Ref:
    record: Record
    version: int
    view: Geometry


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


DEVICE = _Marker("DEVICE")
TARGET = _Marker("TARGET")


@dataclass(frozen=True)
class Binding:
    """A parameter or buffer's record, and its own view of the storage."""

    record: Record
    view: Geometry


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, list | tuple):
        for item in tree:
            yield from _leaves(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _leaves(item)
    else:
        yield tree


def _outputs(tree: Any, path: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], Any]]:
    if isinstance(tree, list | tuple):
        for k, item in enumerate(tree):
            yield from _outputs(item, (*path, k))
    else:
        yield path, tree


def _map(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(tree, list | tuple) and not hasattr(tree, "_fields"):
        return type(tree)(_map(item, fn) for item in tree)
    if isinstance(tree, dict):
        return {k: _map(v, fn) for k, v in tree.items()}
    return fn(tree)


def _storage_key(t: Any) -> int | None:
    if not isinstance(t, torch.Tensor) or not t.is_meta:
        return None
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError):  # tensors without a storage of their own
        return None


def _is_meta_device(value: Any) -> bool:
    return (isinstance(value, torch.device) and value.type == "meta") or (isinstance(value, str) and value == "meta")


class Recorder(TorchFunctionMode):
    """The torch function mode that records meta storages' histories while `zero_init` is active."""

    def __init__(self) -> None:
        super().__init__()
        self._records: dict[int, Record] = {}  # storage -> its record
        self._alive: list[torch.Tensor] = []  # a tensor per recorded storage: keys are not reused while recording

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        out = func(*args, **kwargs)
        if any(_storage_key(t) is not None for t in itertools.chain(_leaves(args), _leaves(kwargs), _leaves(out))):
            self._record(func, args, kwargs, out)
        return out

    def binding(self, t: torch.Tensor) -> Binding | None:
        key = _storage_key(t)
        record = self._records.get(key) if key is not None else None
        return Binding(record, Geometry.of(t)) if record is not None else None

    def _record(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        name = str(getattr(func, "__name__", ""))
        if name in _NOT_WRITES or name in ("__get__", "__set__"):
            return  # `.data` read (an alias) or rebound (the parameter's storage is another one's from now on)
        target = kwargs.get("out")
        if target is None and (name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))):
            target = args[0] if args else next((kwargs[k] for k in ("tensor", "self", "input") if k in kwargs), None)
        key = _storage_key(target)
        if key is not None:
            record = self._records.get(key)
            if record is not None and isinstance(target, torch.Tensor):  # a write into a storage of ours
                call = self._call(func, args, kwargs, target)
                record.writes.append(Write(next(_SEQUENCE), Geometry.of(target), call))
            return
        creator: Call | None = None
        sequence = next(_SEQUENCE)
        for path, t in _outputs(out):
            key = _storage_key(t)
            if key is None or key in self._records:
                continue  # a view of a storage already recorded, or not a meta tensor
            if creator is None:
                creator = self._call(func, args, kwargs, None)
            self._records[key] = Record(creator, path, sequence, Geometry.of(t))
            self._alive.append(t)

    def _call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], target: Any) -> Call:
        """The call with its meta arguments as references; not replayable if one is a meta tensor made outside the
        recording."""
        unknown = False

        def template(value: Any) -> Any:
            nonlocal unknown
            if target is not None and value is target:
                return TARGET
            if _is_meta_device(value):
                return DEVICE
            key = _storage_key(value)
            if key is None:
                return value
            record = self._records.get(key)
            if record is None:
                unknown = True
                return value
            record.read_at.add(len(record.writes))
            return Ref(record, len(record.writes), Geometry.of(value))

        call = Call(func, _map(args, template), _map(kwargs, template))
        return Call(None, (), {}) if unknown else call

    def close(self) -> None:
        self._records.clear()
        self._alive.clear()


class Replay:
    """Records evaluated on `device`: each storage once per replay, advanced write by write; a version another call
    read is kept aside when the storage moves past it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._results: dict[int, Any] = {}  # id(call) -> its outputs
        self._now: dict[int, tuple[torch.Tensor, int]] = {}  # id(record) -> (over the whole storage, version)
        self._kept: dict[tuple[int, int], torch.Tensor] = {}

    def fill(self, targets: list[tuple[torch.Tensor, Binding, str]]) -> None:
        """Each real `tensor` gets its binding's value; the records' events replayed in the order they happened."""
        events: list[tuple[int, Record, int]] = []
        for record in dict.fromkeys(b.record for _, b, _ in targets):
            events.append((record.sequence, record, 0))
            events += [(w.sequence, record, k + 1) for k, w in enumerate(record.writes)]
        with torch.no_grad(), torch.device(self.device):
            for _, record, version in sorted(events, key=lambda e: e[0]):
                self._value(record, version)
            for tensor, binding, name in targets:
                value = self._view(self._value(binding.record, len(binding.record.writes)), binding.view, name)
                tensor.copy_(value)

    def _value(self, record: Record, version: int) -> torch.Tensor:
        kept = self._kept.get((id(record), version))
        if kept is not None:
            return kept
        now = self._now.get(id(record))
        if now is None:
            now = (self._create(record), 0)
        base, at = now
        if at > version:
            raise ZeroshardError(f"zero_init replay: version {version} of a storage was not kept")  # a recorder bug
        while at < version:
            if at in record.read_at:
                self._kept[(id(record), at)] = base.clone()
            write = record.writes[at]
            self._run(write.call, self._view(base, write.into, write.call.name))
            at += 1
        self._now[id(record)] = (base, at)
        return base

    def _create(self, record: Record) -> torch.Tensor:
        results = self._results.get(id(record.creator))
        if results is None:
            results = self._results[id(record.creator)] = self._run(record.creator, None)
        out = results
        for k in record.path:
            out = out[k]
        made = record.made
        if tuple(out.stride()) != made.stride or out.storage_offset() != made.offset:
            # laid out unlike its meta twin: copied into the meta geometry, which later views are taken from
            base = torch.empty(made.offset + _extent(made), dtype=made.dtype, device=self.device)
            base.as_strided(made.size, made.stride, made.offset).copy_(out)
            return base
        return out

    def _view(self, base: torch.Tensor, view: Geometry, name: str) -> torch.Tensor:
        if view.dtype != base.dtype:
            raise ZeroshardError(f"zero_init replay: {name} read a storage as {view.dtype}, made as {base.dtype}")
        return base.as_strided(view.size, view.stride, view.offset)

    def _run(self, call: Call, target: torch.Tensor | None) -> Any:
        def real(value: Any) -> Any:
            if value is TARGET:
                return target
            if value is DEVICE:
                return self.device
            if isinstance(value, Ref):
                return self._view(self._value(value.record, value.version), value.view, call.name)
            return value

        assert call.func is not None  # only records that initialise are replayed
        try:
            return call.func(*_map(call.args, real), **_map(call.kwargs, real))
        except ZeroshardError:
            raise
        except Exception as e:
            raise ZeroshardError(
                f"zero_init: replaying {call.name}, which the model's code ran on the meta device, failed on "
                f"{self.device}: {e}"
            ) from e


def _extent(view: Geometry) -> int:
    return 1 + sum((s - 1) * st for s, st in zip(view.size, view.stride, strict=True)) if all(view.size) else 0


# module -> its own parameters' and buffers' bindings, by name ([Note: initialisation recorded under zero_init])
_BOUND: weakref.WeakKeyDictionary[nn.Module, dict[str, Binding]] = weakref.WeakKeyDictionary()


def bind(recorder: Recorder, modules: Iterator[nn.Module]) -> None:
    """At the end of a `zero_init` block: each module's meta parameters and buffers bound to their records."""
    for module in modules:
        own = {**module._parameters, **module._buffers}
        bound = {n: b for n, t in own.items() if t is not None and (b := recorder.binding(t)) is not None}
        if bound:
            _BOUND.setdefault(module, {}).update(bound)


def bindings(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, Binding]:
    """The bindings of `tensors` (the module's own, by name, still on the meta device) that initialise them."""
    bound = _BOUND.get(module, {})
    out = {}
    for name, t in tensors.items():
        b = bound.get(name)
        if b is not None and b.record.initialises() and b.view.size == tuple(t.shape):
            out[name] = b
    return out


def forget(model: nn.Module) -> None:
    """`initialize` made the model real: its records are not needed any more."""
    for module in model.modules():
        _BOUND.pop(module, None)


def transformers_model(root: nn.Module) -> bool:
    """A transformers `PreTrainedModel`: its `_init_weights` was skipped on the meta device and runs at
    materialisation."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    return base is not None and isinstance(root, base)
