"""Recorded meta tensors computed for real ([Note: initialisation recorded under zero_init] in recorded.py)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from zeroshard.errors import ZeroshardError
from zeroshard.loading.recorded import (
    DEVICE,
    TARGET,
    Binding,
    Call,
    Geometry,
    Record,
    Ref,
    Seeded,
    active,
    bindings_of,
    leaves,
    tree_map,
)

_SEED_MIX = 0x9E3779B97F4A7C15  # a call's seed: the model's seed and its place, spread over 63 bits


def _seed(base: int, place: int) -> int:
    return (base + (place + 1) * _SEED_MIX) % (1 << 63)


class Replay:
    """Records evaluated on `device`: each storage once per replay, advanced write by write; a version another call
    read is kept aside when the storage moves past it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._results: dict[int, Any] = {}  # id(call) -> its outputs
        self._now: dict[int, tuple[torch.Tensor, int]] = {}  # id(record) -> (over the whole storage, version)
        self._kept: dict[tuple[int, int], torch.Tensor] = {}

    def fill(self, targets: list[tuple[torch.Tensor, Binding]]) -> None:
        """Each real `tensor` gets its binding's value; the records' events replayed in the order they happened."""
        if not targets:
            return
        events: list[tuple[int, Record, int]] = []
        for record in dict.fromkeys(b.record for _, b in targets):
            events.append((record.creator.sequence, record, 0))
            events += [(w.call.sequence, record, k + 1) for k, w in enumerate(record.writes)]
        with self._own_random_state(), torch.no_grad(), torch.device(self.device):
            for _, record, version in sorted(events, key=lambda e: e[0]):
                now = self._now.get(id(record))
                if now is None or now[1] < version:
                    self._value(record, version)
            for tensor, binding in targets:
                tensor.copy_(self._view(self._value(binding.record, len(binding.record.writes)), binding.view))

    @contextmanager
    def _own_random_state(self) -> Iterator[None]:
        """Calls seed the default generators of the CPU and the target device: put back afterwards."""
        cuda = self.device.type == "cuda"
        index = self.device.index if self.device.index is not None else torch.cuda.current_device() if cuda else 0
        with torch.random.fork_rng(devices=[index] if cuda else []):
            yield

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
            self._run(write.call, self._view(base, write.into))
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
        if out.dtype != made.dtype or tuple(out.stride()) != made.stride or out.storage_offset() != made.offset:
            # laid out unlike its meta twin: copied into the meta geometry, which later views are taken from
            base = torch.empty(made.offset + _extent(made), dtype=made.dtype, device=self.device)
            base.as_strided(made.size, made.stride, made.offset).copy_(out)
            return base
        return out

    def _view(self, base: torch.Tensor, view: Geometry) -> torch.Tensor:
        if view.dtype == base.dtype:
            return base.as_strided(view.size, view.stride, view.offset)
        # the storage read as another dtype (`.real` of a complex tensor, `view(torch.int32)`)
        as_dtype = torch.empty(0, dtype=view.dtype, device=base.device)
        return as_dtype.set_(base.untyped_storage(), view.offset, view.size, view.stride)

    def _run(self, call: Call, target: torch.Tensor | None) -> Any:
        def real(value: Any) -> Any:
            if value is TARGET:
                return target
            if value is DEVICE:
                return self.device
            if isinstance(value, Ref):
                return self._view(self._value(value.record, value.version), value.view)
            if isinstance(value, Seeded):
                generator = torch.Generator(device=self.device)
                generator.manual_seed(_seed(value.seed, call.place))
                return generator
            return value

        assert call.func is not None  # only records that initialise are replayed
        args, kwargs = tree_map(call.args, real), tree_map(call.kwargs, real)
        torch.manual_seed(_seed(call.seed, call.place))
        previous = torch.get_default_dtype()
        torch.set_default_dtype(call.default_dtype)
        try:
            out = call.func(*args, **kwargs)
        except Exception as e:
            raise ZeroshardError(
                f"zero_init: replaying {call.name}, which the model's code ran on the meta device, failed on "
                f"{self.device}: {e}"
            ) from e
        finally:
            torch.set_default_dtype(previous)
        if target is None:  # a creator's output must not be one of its (copied) arguments: replays would compound
            given = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            out = tree_map(out, lambda t: t.clone() if _aliases(t, given) else t)
        return out


def _aliases(value: Any, pointers: set[int]) -> bool:
    return isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in pointers


def _extent(view: Geometry) -> int:
    return 1 + sum((s - 1) * st for s, st in zip(view.size, view.stride, strict=True)) if all(view.size) else 0


# module -> its own parameters' and buffers' bindings, by name ([Note: initialisation recorded under zero_init])
_BOUND: weakref.WeakKeyDictionary[nn.Module, dict[str, Binding]] = weakref.WeakKeyDictionary()


def bind(modules: Iterable[nn.Module]) -> None:
    """At the end of a `zero_init` block: each module's (and each module's under them: `copy.deepcopy`'d layers that
    no registration hook saw) meta parameters and buffers bound to their records. A binding made earlier (a block
    inside the recording) stays where the tensor's storage now has no initialising record."""
    recorder = active()
    if recorder is None:
        return
    seen: set[int] = set()
    for top in modules:
        for module in top.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            bound = _BOUND.setdefault(module, {})
            for name, b in bindings_of(recorder, module).items():
                if name not in bound or b.record.initialises() or not bound[name].record.initialises():
                    bound[name] = b
            if not bound:
                del _BOUND[module]


def bindings(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, Binding]:
    """The bindings of `tensors` (the module's own, by name, still on the meta device) that initialise them; inside
    the recording (a `GatheredParameters` block in `__init__`) also those recorded so far, kept for later."""
    if active() is not None:
        bind([module])
    bound = _BOUND.get(module, {})
    out = {}
    for name, t in tensors.items():
        b = bound.get(name)
        if b is not None and b.record.initialises() and b.view.size == tuple(t.shape):
            out[name] = b
    return out


def module_seed(module: nn.Module) -> int | None:
    """A seed of the module's own for its `reset_parameters()` and `_init_weights` (where they run): from the place
    of its first recorded parameter, so that those draws, too, do not depend on the unit or on a block before
    `initialize`; None for a module without records."""
    for binding in _BOUND.get(module, {}).values():
        return _seed(binding.record.creator.seed, binding.record.creator.place + (1 << 40))
    return None


def continue_recording(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """`tensor`, a fresh meta tensor for a parameter going back to the meta device inside the recording, takes up
    the parameter's record: later writes in the constructor still count."""
    recorder, binding = active(), _BOUND.get(module, {}).get(name)
    if recorder is not None and binding is not None:
        recorder.alias(tensor, binding)


@contextmanager
def unrecorded() -> Iterator[None]:
    """zeroshard's own meta tensors are not the model's."""
    recorder = active()
    if recorder is None:
        yield
        return
    with recorder.paused():
        yield


def forget(model: nn.Module) -> None:
    """`initialize` made the model real: its records are not needed any more."""
    for module in model.modules():
        _BOUND.pop(module, None)


def transformers_init(init: Any) -> bool:
    """`init` is a transformers `PreTrainedModel`'s `_init_weights` (reached through PEFT's wrapper too), which
    transformers skipped on the meta device and runs at materialisation."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    return base is not None and isinstance(getattr(init, "__self__", None), base)
