"""Recorded meta tensors computed for real ([Note: initialisation recorded under zero_init] in recorded.py)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from zeroshard.errors import ZeroshardError
from zeroshard.loading.recorded import (
    DEVICE,
    INIT_AFTER,
    TARGET,
    Binding,
    Call,
    Geometry,
    Record,
    Recorder,
    Ref,
    Seeded,
    active,
    bindings_of,
    leaves,
    tree_map,
)

_SEED_MIX = 0x9E3779B97F4A7C15  # a call's seed: the model's seed and its place, spread over 63 bits


def seed_of(base: int, place: int) -> int:
    return (base + (place + 1) * _SEED_MIX) % (1 << 63)


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The CPU's default generator, and `device`'s where it is a CUDA device, seeded with `seed` for the duration
    and put back afterwards (other devices' generators untouched)."""
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if index is not None else []):
        torch.random.default_generator.manual_seed(seed)
        if index is not None:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


class Replay:
    """Records evaluated on `device`. Every event the targets depend on (each storage's creation, its writes up to
    the version read) runs in the order it was recorded: a call then finds each storage it reads at the version it
    read, with no copies of earlier versions and no recursion. A fresh replay per call of `fill`: values depend only
    on the records (every call draws from its own seed), so a storage two fills reach gets the same values twice."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def fill(self, targets: list[tuple[torch.Tensor, Binding]]) -> None:
        """Each real `tensor` gets its binding's value."""
        if not targets:
            return
        needed = needed_records({b.record: len(b.record.writes) for _, b in targets})
        events: list[tuple[int, Record, int]] = []
        for record, version in needed.items():
            events.append((record.creator.sequence, record, 0))
            events += [(record.writes[k].call.sequence, record, k + 1) for k in range(version)]
        now: dict[int, tuple[torch.Tensor, int]] = {}  # id(record) -> (over the whole storage, version)
        results: dict[int, Any] = {}  # id(call) -> its outputs (one call can create several storages)
        with torch.no_grad(), torch.device(self.device):
            for _, record, version in sorted(events, key=lambda e: (e[0], e[2])):
                if version == 0:
                    call = record.creator
                    if id(call) not in results:
                        results[id(call)] = self._run(call, None, now)
                    now[id(record)] = (self._created(record, results[id(call)]), 0)
                    continue
                base, at = now[id(record)]
                write = record.writes[at]
                self._run(write.call, self._view(base, write.into), now)
                now[id(record)] = (base, at + 1)
            for tensor, binding in targets:
                tensor.copy_(self._view(now[id(binding.record)][0], binding.view))

    def _created(self, record: Record, results: Any) -> torch.Tensor:
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

    def _run(self, call: Call, target: torch.Tensor | None, now: dict[int, tuple[torch.Tensor, int]]) -> Any:
        def real(value: Any) -> Any:
            if value is TARGET:
                return target
            if value is DEVICE:
                return self.device
            if isinstance(value, Ref):
                base, at = now[id(value.record)]
                if at != value.version:  # a recorder bug: events run in the order they were recorded
                    raise ZeroshardError(f"zero_init replay: {call.name} read version {value.version}, found {at}")
                return self._view(base, value.view)
            if isinstance(value, Seeded):
                generator = torch.Generator(device=self.device)
                generator.manual_seed(seed_of(value.seed, call.place))
                return generator
            if isinstance(value, torch.Tensor):  # a copy per replay: a call may write into it, or return it
                return value.clone()
            if isinstance(value, np.ndarray):
                return value.copy()
            return value

        assert call.func is not None  # only records that initialise are replayed
        args, kwargs = tree_map(call.args, real), tree_map(call.kwargs, real)
        previous = torch.get_default_dtype()
        try:
            with seeded(seed_of(call.seed, call.place), self.device):
                torch.set_default_dtype(call.default_dtype)
                return call.func(*args, **kwargs)
        except ZeroshardError:
            raise
        except Exception as e:
            raise ZeroshardError(
                f"zero_init: replaying {call.name}, which the model's code ran on the meta device, failed on "
                f"{self.device}: {e}"
            ) from e
        finally:
            torch.set_default_dtype(previous)


def needed_records(targets: dict[Record, int]) -> dict[Record, int]:
    """Every record the targets read, with the last version read (a worklist: reading more of a storage's writes
    can reach more storages)."""
    needed = dict(targets)
    done: dict[Record, int] = {}
    work = list(needed)
    while work:
        record = work.pop()
        version = needed[record]
        start = done.get(record)
        calls = [w.call for w in record.writes[start or 0 : version]]
        if start is None:
            calls.append(record.creator)
        done[record] = version
        for ref in (r for c in calls for r in leaves((c.args, c.kwargs)) if isinstance(r, Ref)):
            if needed.get(ref.record, -1) < ref.version:
                needed[ref.record] = ref.version
                work.append(ref.record)
    return needed


def _extent(view: Geometry) -> int:
    return 1 + sum((s - 1) * st for s, st in zip(view.size, view.stride, strict=True)) if all(view.size) else 0


# module -> its own parameters' and buffers' bindings, by name ([Note: initialisation recorded under zero_init])
_BOUND: weakref.WeakKeyDictionary[nn.Module, dict[str, Binding]] = weakref.WeakKeyDictionary()


def bind(modules: Iterable[nn.Module]) -> None:
    """At the end of a `zero_init` block: each module's (and each module's under them: `copy.deepcopy`'d layers that
    no registration hook saw) meta parameters and buffers bound to their records; a transformers model whose
    initialisation the recorder did not see runs `_init_weights` after the replay, as before."""
    recorder = active()
    if recorder is None:
        return
    seen: set[int] = set()
    for top in modules:
        for module in top.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            if _transformers_model(module) and module not in recorder.initialised:
                INIT_AFTER.add(module)
            _bind_one(recorder, module)


def _bind_one(recorder: Recorder, module: nn.Module) -> None:
    """A binding made earlier (a block inside the recording) stays where the tensor's storage now has no initialising
    record (the block gave the parameter a fresh meta tensor)."""
    bound = _BOUND.setdefault(module, {})
    for name, b in bindings_of(recorder, module).items():
        if name not in bound or b.record.initialises() or not bound[name].record.initialises():
            bound[name] = b
    if not bound:
        del _BOUND[module]


def bindings(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, Binding]:
    """The bindings of `tensors` (the module's own, by name, still on the meta device) that initialise them; inside
    the recording (a `GatheredParameters` block in `__init__`) also those recorded so far, kept for later."""
    recorder = active()
    if recorder is not None:  # mid-construction: this module's records so far
        _bind_one(recorder, module)
    bound = _BOUND.get(module, {})
    out = {}
    for name, t in tensors.items():
        b = bound.get(name)
        if b is not None and b.record.initialises() and b.view.size == tuple(t.shape):
            out[name] = b
    return out


def share_bindings(copy: nn.Module, original: nn.Module) -> None:
    """`copy` (a deep copy of `original` made after the `zero_init` block, which no recording saw) takes the
    original's bindings, module by module: its meta tensors get the original's values, and its modules the original's
    seeds."""
    for name, source in original.named_modules():
        bound = _BOUND.get(source)
        if bound is not None:
            _BOUND.setdefault(copy.get_submodule(name), {}).update(bound)


def module_seed(module: nn.Module, recurse: bool = False) -> int | None:
    """A seed of the module's own for its `reset_parameters()` and `_init_weights` (where they run): from the place
    of its first recorded parameter (`recurse`: or its first module's with one), so that those draws, too, do not
    depend on the unit or on a block before `initialize`; None for a module without records."""
    for each in module.modules() if recurse else (module,):
        for binding in _BOUND.get(each, {}).values():
            creator = binding.record.creator
            return seed_of(creator.seed, creator.place + binding.view.offset + (1 << 40) + (1 << 41) * recurse)
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


def _transformers_model(module: nn.Module) -> bool:
    modeling = sys.modules.get("transformers.modeling_utils")
    base = getattr(modeling, "PreTrainedModel", None)
    return base is not None and isinstance(module, base)


def init_after(init: Any) -> bool:
    """`init` is the `_init_weights` of a transformers model whose initialisation was not recorded (it could not run
    on the meta device, or was not seen): it runs module by module after the replay."""
    return getattr(init, "__self__", None) in INIT_AFTER
