"""The ranks of a tensor-parallel group read one batch, checked at the first forward.

[Note: a tensor-parallel group reads one batch]
AutoTP splits each layer's weights over the ranks of a tensor-parallel group, which then compute one forward together:
they must be given the same inputs. A script's own DataLoader sharded over the whole world (a `DistributedSampler`
with the world's rank) gives each of them other samples, and training runs on, on a mixture no rank's data describes
(measured: no error, both ranks' output the same mixed value). DeepSpeed's engine checks the first forward's
arguments across the group and stops with "Data inconsistency within the TP group". Here, at the module's first
forward under AutoTP, each rank digests its positional and keyword inputs (each tensor's shape, dtype and bytes; other
values by their text, or their type where the text could name an address), the group gathers the digests once, and
where any rank differs every rank of the group raises the same error naming the first input that differs and the
ranks, before the forward runs. One exchange of a few bytes per input, once: later batches come from the same loader.
An mpu's split model (Megatron's layers) is not checked, as DeepSpeed checks only AutoTP.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard.errors import ZeroshardError
from zeroshard.tp.mesh import TensorParallelContext

_PLAIN = (int, float, str, bool, type(None))


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key in value:
            yield from _leaves(value[key], f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def _digest(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().cpu()
        crc = zlib.crc32(data.reshape(-1).view(torch.uint8).numpy().tobytes()) if data.numel() else 0
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} {crc:08x}"
    if isinstance(value, _PLAIN):
        return repr(value)
    return f"<{type(value).__qualname__}>"


def input_digests(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, str]:
    """Each input leaf's digest, by its path (`args[0]`, `kwargs['input_ids']`, ...)."""
    leaves = [*_leaves(list(args), "args"), *_leaves(dict(kwargs), "kwargs")]
    return {path: _digest(value) for path, value in leaves}


def _first_difference(digests: list[dict[str, str]]) -> str | None:
    reference = digests[0]
    for mine in digests[1:]:
        if mine == reference:
            continue
        for path in sorted(set(reference) | set(mine)):
            if reference.get(path) != mine.get(path):
                return path
    return None


def first_batch_check(module: nn.Module, tp: TensorParallelContext | None) -> RemovableHandle | None:
    """[Note: a tensor-parallel group reads one batch] A one-shot forward pre-hook over AutoTP's tensor-parallel
    group; None without AutoTP (or at tp 1)."""
    if tp is None or tp.tp_mesh is None or tp.tp_size == 1:
        return None
    group, ranks = tp.tp_comm.group, [tp.tp_comm.global_rank(i) for i in range(tp.tp_size)]
    handle: RemovableHandle | None = None

    def check(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert handle is not None
        handle.remove()
        mine = input_digests(args, kwargs)
        digests: list[Any] = [None] * len(ranks)
        dist.all_gather_object(digests, mine, group=group)
        path = _first_difference(digests)
        if path is None:
            return
        differing = [ranks[i] for i, d in enumerate(digests) if d.get(path) != digests[0].get(path)]
        raise ZeroshardError(
            f"tensor parallelism: the ranks of tensor-parallel group {ranks} were given different inputs at the first "
            f"forward ({path} differs on ranks {differing} from rank {ranks[0]}'s); the ranks of a tensor-parallel "
            "group compute one forward and must read the same batch: shard the data over the data-parallel ranks "
            "(engine.data_parallel_group; the engine's own loader does), not over the world"
        )

    handle = module.register_forward_pre_hook(check, prepend=True, with_kwargs=True)
    return handle
