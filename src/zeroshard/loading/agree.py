"""Every rank starts from the same model when `zero_init` built it: the data-parallel group's first rank's.

[Note: one start on every rank]
A model built under `zero_init` stays on the meta device until `initialize`, where each rank replays the
initialisation it recorded ([Note: initialisation recorded under zero_init]) and keeps its shard. Each recorded call
draws from its rank's seed: ranks that seeded differently before building (accelerate's
`set_seed(device_specific=True)`, a script's `torch.manual_seed(seed + rank)`), or whose code branched on the rank,
recorded different initialisations. Their shards then came from different models (a patchwork no rank built), and
stage 3's persistent parameters (replicated below `stage3_param_persistence_threshold`) differed between ranks until
the first step: a first forward, or an evaluation before training, gave each rank another model's answer. DeepSpeed's
`zero.Init` broadcasts each parameter from rank 0 as it is built: rank 0's model everywhere. zeroshard:
- keeps the replay local (no parameter bytes on the wire) when the ranks would compute the same values, and agrees
  first: `fingerprint` digests everything materialising the model's meta parameters depends on (each call in
  recorded order, its seed and place, its arguments exactly: references numbered by record, real tensors and arrays
  by content, shapes, slices, numpy scalars and enums by value; the bindings; the seed each module's own
  `reset_parameters()`/`_init_weights` runs under, or the process's seed where a module has none), and one small
  broadcast compares it with the data-parallel group's first rank. Where any rank differs, or an argument cannot be
  compared exactly (an object of an unknown kind), that rank's values are broadcast once: unit by unit at stage 3
  (each parameter with its own unit, after the unit's replay and before it is sharded, also when another unit's
  module init made it real earlier), whole on the fsdp2 backend (before `fully_shard`), with one line in the log;
- always broadcasts from that rank, in `initialize`, what is already whole on every rank: the real parameters no
  `GatheredParameters` block or load kept (PEFT's LoRA adapters of a meta base, whose lora_A draws from the process's
  generator; a head attached after the `zero_init` block; a constructor's real tensors, e.g. from numpy) and the
  buffers (a parameter-less module's init draws from the process's generator), and the buffers again once every unit
  is built where any was replayed (a module's `reset_parameters()` may draw them as its unit is built).
Tensors a checkpoint fills (`from_pretrained` under `zero_init`) are the same on every rank and are left out.
Tested (tests/distributed/test_zero_init_ranks.py): seeds that differ before building, only after it, and code that
depends on the rank (a slice, a numpy scalar) give the first rank's model at stage 3 (thresholds 0, 100, 1e5) and
on fsdp2; seeds that differ only after building move no parameter values.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from enum import Enum
from typing import Any

import numpy as np
import torch
from torch import nn

from zeroshard.comm.collectives import Collectives
from zeroshard.loading.recorded import DEVICE, TARGET, Binding, Call, Ref, Seeded
from zeroshard.loading.replay import bindings, module_seed, needed_records
from zeroshard.loading.weights import StreamedWeights

logger = logging.getLogger("zeroshard")

_DIGEST_WORDS = 2  # int64 words of the blake2b digest compared across ranks


def fingerprint(model: nn.Module, filled: Callable[[torch.Tensor], bool] = lambda _: False) -> bytes | None:
    """A digest of what materialising `model`'s meta parameters and buffers (those `filled` does not cover)
    computes: equal on two ranks when their replays and their modules' own initialisations give the same values;
    None when a recorded argument cannot be compared exactly (an object of an unknown kind: the caller broadcasts)."""
    digest = hashlib.blake2b(digest_size=8 * _DIGEST_WORDS)
    if torch.cuda.is_available():  # CUDA's random fills depend on the device's SM count (their Philox offsets): ranks
        props = torch.cuda.get_device_properties(torch.cuda.current_device())  # on other GPU models (MIG) differ
        digest.update(f"device {props.name} {props.multi_processor_count}\n".encode())
    bound: list[tuple[str, Binding]] = []
    for path, module in model.named_modules():
        tensors = {n: t for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None}
        meta = {n: t for n, t in tensors.items() if t.is_meta and not filled(t)}
        if not meta:
            continue
        found = bindings(module, meta)
        bound += [(f"{path}.{n}", b) for n, b in found.items()]
        # reset_parameters() and _init_weights draw under the module's seed (from its records, initialising or
        # not), or under the process's seed and the unit's number where it has none (materialize.initialise)
        seed = module_seed(module)
        digest.update(f"module {path} {seed if seed is not None else torch.initial_seed()}\n".encode())
    needed = needed_records({b.record: len(b.record.writes) for _, b in bound})
    number = {id(r): k for k, r in enumerate(sorted(needed, key=lambda r: (r.creator.sequence, r.path)))}
    events: list[tuple[int, int, str, Call]] = []
    for record, version in needed.items():
        events.append(
            (record.creator.sequence, 0, f"make {number[id(record)]} {record.path} {record.made}", record.creator)
        )
        events += [
            (w.call.sequence, k + 1, f"write {number[id(record)]} {w.into}", w.call)
            for k, w in enumerate(record.writes[:version])
        ]
    done: set[int] = set()
    try:
        for _, _, what, call in sorted(events, key=lambda e: (e[0], e[1])):
            digest.update(what.encode())
            if id(call) not in done:  # a call that made several storages counts once
                done.add(id(call))
                digest.update(_call_text(call, number).encode())
    except _Inexact:
        return None
    for name, b in bound:
        digest.update(f"bind {name} {number[id(b.record)]} {b.view}\n".encode())
    return digest.digest()


class _Inexact(Exception):
    """A recorded argument whose text would not say exactly what the replay receives."""


_EXACT = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _call_text(call: Call, number: dict[int, int]) -> str:
    def text(value: Any) -> str:
        if value is None or value is Ellipsis or isinstance(value, _EXACT):
            return repr(value)
        if isinstance(value, Enum):
            return f"{type(value).__qualname__}.{value.name}={text(value.value)}"
        if isinstance(value, tuple | list):  # torch.Size and named tuples too: the values, in order
            return f"{type(value).__name__}({','.join(text(v) for v in value)})"
        if isinstance(value, dict):
            return "{" + ",".join(f"{text(k)}:{text(v)}" for k, v in value.items()) + "}"
        if isinstance(value, slice):
            return f"slice({text(value.start)},{text(value.stop)},{text(value.step)})"
        if isinstance(value, Ref):
            return f"ref({number[id(value.record)]},{value.version},{value.view})"
        if isinstance(value, Seeded):
            return f"generator({value.seed})"
        if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_quantized:
            data = value.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
            return f"tensor({value.dtype},{tuple(value.shape)},{hashlib.blake2b(data).hexdigest()})"
        if isinstance(value, np.ndarray) and value.dtype != object:
            data = np.ascontiguousarray(value).tobytes()
            return f"array({value.dtype},{value.shape},{hashlib.blake2b(data).hexdigest()})"
        if isinstance(value, np.generic):
            return f"np.{value.dtype}({value.item()!r})"
        if value is DEVICE or value is TARGET:
            return repr(value)
        if callable(value) and hasattr(value, "__qualname__"):  # a function or a class: the same code by name
            return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
        raise _Inexact(type(value).__qualname__)

    func = call.func
    name = "unreplayable" if func is None else f"{getattr(func, '__module__', '')}.{call.name}"
    return f"{name} {call.seed} {call.place} {call.default_dtype} {text(call.args)} {text(call.kwargs)}\n"


def differing_start(
    model: nn.Module, comm: Collectives, device: torch.device, weights: StreamedWeights | None
) -> int | None:
    """The global rank whose initialisation every rank of `comm`'s group must take, when some rank of the group
    recorded another one ([Note: one start on every rank]); None when all recorded the same (or there is nothing to
    replay). Collective over the group."""
    if comm.world_size == 1 or not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return None
    filled = weights.covers if weights is not None else (lambda _: False)
    digest = fingerprint(model, filled)
    words = np.frombuffer(digest or bytes(8 * _DIGEST_WORDS), dtype=np.int64).copy()
    mine = torch.from_numpy(words).to(device)
    first = mine.clone()
    src = comm.global_rank(0)
    comm.broadcast(first, src=src, label="zero_init fingerprint")
    if not comm.any_true(digest is None or not torch.equal(first, mine), device):
        return None
    if comm.rank == 0:
        logger.info(
            "zero_init: the ranks recorded different initialisations (seeded differently before building, or code "
            "that depends on the rank); every rank starts from rank %d's values, broadcast once as DeepSpeed's "
            "zero.Init does (the same seed on every rank before building keeps the replay local)",
            src,
        )
    return src
