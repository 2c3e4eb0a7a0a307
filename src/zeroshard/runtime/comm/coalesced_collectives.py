"""`deepspeed.runtime.comm.coalesced_collectives`: `reduce_scatter_coalesced`, several tensors averaged and cut
over a group in one reduce-scatter. DeepSpeed's quantized variant (`all_to_all_quant_reduce`, its CUDA quantizer
op) is not provided: zeroshard's qgZ quantizes gradients inside the engine (`zero_quantized_gradients`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from zeroshard.comm import api as comm


@torch.no_grad()
def reduce_scatter_coalesced(tensors: list[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """Each tensor flattened and cut into `world` parts of ceil(numel / world) elements (the last ones shorter or
    empty); returns this rank's part of each, averaged over `group`, as DeepSpeed's. The inputs are not changed
    (DeepSpeed divides a lone, evenly cut input in place). A collective: every rank of `group` calls it with tensors
    of the same sizes.

    Example:
        >>> (part,) = reduce_scatter_coalesced([torch.ones(6)])  # doctest: +SKIP
    """
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    padded = [math.ceil(t.numel() / world) for t in tensors]
    pieces = []
    for r in range(world):  # rank r's parts of every tensor, side by side, each padded to its full width
        for tensor, width in zip(tensors, padded, strict=True):
            chunk = tensor.reshape(-1)[r * width : (r + 1) * width]
            pieces.append(chunk)
            if chunk.numel() < width:
                pieces.append(chunk.new_zeros(width - chunk.numel()))
    flat = torch.cat(pieces) if pieces else torch.empty(0)
    flat.div_(world)
    mine = flat.new_empty(sum(padded))
    comm.reduce_scatter_tensor(mine, flat, group=group)
    outputs, offset = [], 0
    for tensor, width in zip(tensors, padded, strict=True):
        kept = max(0, min(width, tensor.numel() - rank * width))
        outputs.append(mine.narrow(0, offset, kept))
        offset += width
    return outputs


__all__ = ["reduce_scatter_coalesced"]
