"""Every rank starts from the same model when `zero_init` built it: rank 0's.

[Note: one start on every rank]
A model built under `zero_init` stays on the meta device until `initialize`, where each rank replays the
initialisation it recorded ([Note: initialisation recorded under zero_init]) and keeps its shard. Each recorded call
draws from its rank's seed: ranks that seeded differently before building (accelerate's
`set_seed(device_specific=True)`, a script's `torch.manual_seed(seed + rank)`), or whose code branched on the rank,
recorded different initialisations. Their shards then came from different models (a patchwork no rank built), and
stage 3's persistent parameters (replicated below `stage3_param_persistence_threshold`) differed between ranks until
the first step: a first forward, or an evaluation before training, gave each rank another model's answer. DeepSpeed's
`zero.Init` broadcasts each parameter from rank 0 as it is built: rank 0's model everywhere.
zeroshard keeps the replay local (no bytes on the wire) when the ranks recorded the same thing, and agrees first:
`fingerprint` digests everything the replay of the model's meta tensors depends on (each call in recorded order,
its seed and place, its arguments with references numbered by record, real arguments by content, the bindings; the
process's seed where a module's own `reset_parameters()` runs for tensors without a record), one small broadcast
compares it with the sharding group's first rank, and where any rank differs, that rank's values are broadcast once,
unit by unit at stage 3 (after the unit's replay, before it is sharded) and whole on the fsdp2 backend (before
`fully_shard`), with one line in the log. Tensors a checkpoint fills (`from_pretrained` under `zero_init`) are the
same on every rank and are left out of both.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from zeroshard.comm.collectives import Collectives
from zeroshard.loading.recorded import Binding, Call, Ref, Seeded, tree_map
from zeroshard.loading.replay import bindings, needed_records
from zeroshard.loading.weights import StreamedWeights

logger = logging.getLogger("zeroshard")

_DIGEST_WORDS = 2  # int64 words of the blake2b digest compared across ranks


def fingerprint(model: nn.Module, filled: Callable[[torch.Tensor], bool] = lambda _: False) -> bytes:
    """A digest of what replaying `model`'s meta parameters and buffers (those `filled` does not cover) computes:
    equal on two ranks exactly when their replays give the same values."""
    digest = hashlib.blake2b(digest_size=8 * _DIGEST_WORDS)
    bound: list[tuple[str, Binding]] = []
    unrecorded = False
    for path, module in model.named_modules():
        tensors = {n: t for n, t in [*module._parameters.items(), *module._buffers.items()] if t is not None}
        meta = {n: t for n, t in tensors.items() if t.is_meta and not filled(t)}
        found = bindings(module, meta)
        unrecorded |= len(found) < len(meta)
        bound += [(f"{path}.{n}", b) for n, b in found.items()]
    if unrecorded:  # initialise's and reset_parameters()' draws without a record: the process's seed
        digest.update(f"unrecorded {torch.initial_seed()}\n".encode())
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
    for _, _, what, call in sorted(events, key=lambda e: (e[0], e[1])):
        digest.update(what.encode())
        if id(call) not in done:  # a call that made several storages counts once
            done.add(id(call))
            digest.update(_call_text(call, number).encode())
    for name, b in bound:
        digest.update(f"bind {name} {number[id(b.record)]} {b.view}\n".encode())
    return digest.digest()


def _call_text(call: Call, number: dict[int, int]) -> str:
    def leaf(value: Any) -> str:
        if isinstance(value, Ref):
            return f"ref({number[id(value.record)]}, {value.version}, {value.view})"
        if isinstance(value, Seeded):
            return f"generator({value.seed})"
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
            return f"tensor({value.dtype}, {tuple(value.shape)}, {hashlib.blake2b(data).hexdigest()})"
        if isinstance(value, np.ndarray):
            data = np.ascontiguousarray(value).tobytes()
            return f"array({value.dtype}, {value.shape}, {hashlib.blake2b(data).hexdigest()})"
        if value is None or isinstance(value, bool | int | float | complex | str | torch.dtype | torch.device):
            return repr(value)
        # a callable or an object: its kind, not its address (which differs between processes)
        return f"<{getattr(value, '__qualname__', type(value).__qualname__)}>"

    func = call.func
    name = "unreplayable" if func is None else f"{getattr(func, '__module__', '')}.{call.name}"
    args = (tree_map(call.args, leaf), tree_map(call.kwargs, leaf))
    return f"{name} {call.seed} {call.place} {call.default_dtype} {args!r}\n"


def differing_start(
    model: nn.Module, comm: Collectives, device: torch.device, weights: StreamedWeights | None
) -> int | None:
    """The global rank whose initialisation every rank of `comm`'s group must take, when some rank of the group
    recorded another one ([Note: one start on every rank]); None when all recorded the same (or there is nothing to
    replay). Collective over the group."""
    if comm.world_size == 1 or not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return None
    filled = weights.covers if weights is not None else (lambda _: False)
    words = np.frombuffer(fingerprint(model, filled), dtype=np.int64).copy()
    mine = torch.from_numpy(words).to(device)
    first = mine.clone()
    src = comm.global_rank(0)
    comm.broadcast(first, src=src, label="zero_init fingerprint")
    if not comm.any_true(not torch.equal(first, mine), device):
        return None
    if comm.rank == 0:
        logger.info(
            "zero_init: the ranks recorded different initialisations (seeded differently before building, or code "
            "that depends on the rank); every rank starts from rank %d's values, broadcast once as DeepSpeed's "
            "zero.Init does (the same seed on every rank before building keeps the replay local)",
            src,
        )
    return src
