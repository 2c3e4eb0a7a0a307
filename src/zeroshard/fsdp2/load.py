"""What the module looks like before `fully_shard` takes it, and a checkpoint streamed straight into FSDP2's shards.

[Note: fsdp2 streaming load]
A model `zero_init` built on the meta device from a safetensors folder ([Note: weights of a meta model]) is
sharded while still on the meta device; `to_empty` then gives every rank storage for its rows only, and each rank
reads its element ranges ([Note: fsdp2 shards are element ranges]) from the files: no rank ever holds the whole
model, as with the zero backend's stage 3. The checkpoint's tensors are found by the identity of the meta
parameters, recorded before `fully_shard` replaces them. When the checkpoint lacks a parameter (it must then be
initialised by its module, which FSDP2's DTensors would do differently from a whole tensor) or only part of the
model is on the meta device, every rank reads the whole checkpoint first instead (as stages 0-2 do).

FSDP2's sharded parameters are the fp32 master weights ([Note: fsdp2 mapping]): a model given in bf16/fp16 is
cast to fp32 first (its parameter objects kept), as the zero backend makes fp32 masters from it.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.fsdp2.params import sharded_param
from zeroshard.loading.materialize import materialize_parameters
from zeroshard.loading.weights import StreamedWeights


def streams_shards(
    module: nn.Module, weights: StreamedWeights | None, device: torch.device
) -> dict[str, nn.Parameter] | None:
    """The meta parameters by name when the checkpoint can be read shard by shard after `fully_shard` ([Note:
    fsdp2 streaming load]); else None, having made every meta parameter real (whole, on every rank)."""
    named = dict(module.named_parameters())
    if not any(p.is_meta for p in named.values()):
        return None
    if weights is not None and all(p.is_meta and weights.covers(p) for p in named.values()):
        return named
    materialize_parameters(module, weights, device)
    return None


def masters_in_fp32(module: nn.Module, frozen_dtype: torch.dtype) -> None:
    """Trainable floating parameters in fp32 (they are the masters), frozen ones in `frozen_dtype` (the compute
    dtype: a LoRA base costs 2 bytes per parameter / N at bf16, as on the zero backend's stage 3); the Python
    objects kept (checkpoint reads find them by identity). FSDP2 asks one dtype of the trainable ones only."""
    for param in module.parameters():
        dtype = torch.float32 if param.requires_grad else frozen_dtype
        if param.is_floating_point() and param.dtype != dtype:
            cast = torch.empty(param.shape, dtype=dtype, device=param.device)
            if not param.is_meta:
                cast.copy_(param.detach())
            torch.utils.swap_tensors(param, nn.Parameter(cast, requires_grad=param.requires_grad))


def fill_shards(
    module: nn.Module,
    originals: dict[str, nn.Parameter],
    weights: StreamedWeights,
    device: torch.device,
    rank: int,
    world_size: int,
) -> None:
    """Storage for this rank's rows of every sharded meta parameter on `device` (the host under CPU offload), read
    from the checkpoint; buffers, already real where they belong, are kept as they are."""
    buffers = [(mod, name, buf) for mod in module.modules() for name, buf in mod.named_buffers(recurse=False)]
    module.to_empty(device=device)  # FSDP2 re-pads its sharded storage after this (FSDPParam.reset_sharded_param)
    for mod, name, buf in buffers:
        setattr(mod, name, buf)
    with torch.no_grad():
        for name, param in module.named_parameters():
            sp = sharded_param(name, param, -1, rank, world_size)
            if sp.numel > 0:
                weights.read(originals[name], sp.begin, sp.end, sp.master.view(-1))
