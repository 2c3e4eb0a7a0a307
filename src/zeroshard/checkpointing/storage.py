"""Where a checkpointed input waits between forward and recompute: whole, 1/N of it, in host memory, or in a
preallocated buffer; and how it comes back.

[Note: what is partitioned] As DeepSpeed, `partition_activations` splits an input across the *model-parallel*
group given to `configure(mpu_)`: those ranks hold the same activation, so each keeps 1/N and the all-gather in
backward rebuilds it. Data-parallel ranks hold different activations, so there is nothing to share between them:
without an mpu (or with a model-parallel size of 1) the input is kept whole. Unlike DeepSpeed we pad an input
whose size N does not divide instead of refusing it.

[Note: host copies on a side stream] cpu_checkpointing on CUDA copies the input to pinned host memory on a side
stream that first waits for the compute stream, so the copy overlaps the following layers' forward; the device
tensor is marked as used by that stream so its memory is not reused before the copy has read it. In backward the
copy back runs on the same stream and the compute stream waits for it before the recompute. An input the script
writes in place after its checkpoint (before the copy ran) would be kept with the new values: the recompute needs
the input as the forward saw it, as torch's own checkpoint does (DeepSpeed copies synchronously).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from zeroshard.checkpointing.context import CheckpointingContext
from zeroshard.comm.api import all_gather_into_tensor
from zeroshard.errors import ConfigError


@dataclass
class Kept:
    """One checkpointed input as kept: `data` (whole or this rank's piece, on the device or the host)."""

    data: torch.Tensor
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    partitioned: bool
    on_host: bool
    in_piece: bool = False  # held in a contiguous piece, given back when this dies

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def is_activation(item: object, ctx: CheckpointingContext) -> bool:
    """A floating-point tensor is an activation to keep specially (DeepSpeed's `is_activation_to_checkpoint`)."""
    return isinstance(item, torch.Tensor) and item.is_floating_point() and item.numel() >= ctx.model_parallel.size


def keep(tensor: torch.Tensor, position: int, ctx: CheckpointingContext) -> Kept:
    s = ctx.settings
    mp = ctx.model_parallel
    data = tensor.detach()
    partitioned = s.partition_activations and mp.size > 1
    piece = None
    if partitioned:
        chunk = -(-data.numel() // mp.size)
        flat = data.reshape(-1)
        if flat.numel() < chunk * mp.size:
            flat = torch.nn.functional.pad(flat, (0, chunk * mp.size - flat.numel()))
        data = flat.narrow(0, chunk * mp.rank, chunk)
    if s.contiguous_memory_optimization and s.partition_activations:  # (alone it does nothing, as in DeepSpeed)
        device = torch.device("cpu") if s.cpu_checkpointing else data.device
        if s.number_checkpoints is None:  # (configure refuses it; DeepSpeed's module globals can be written apart)
            raise ConfigError(
                "activation checkpointing: contiguous_memory_optimization needs number_checkpoints (DeepSpeed's "
                "num_layers), the number of checkpoints per forward"
            )
        data, piece = ctx.buffers.take(position, data, s.number_checkpoints, device)
    elif s.cpu_checkpointing:
        data = _to_host(data, ctx)
    elif partitioned:
        data = data.clone()  # the piece alone: the whole input can be freed
    kept = Kept(data, tensor.shape, tensor.device, tensor.requires_grad, partitioned, s.cpu_checkpointing)
    if piece is not None:  # [Note: contiguous pieces are taken and given back] in context.py
        kept.in_piece = True
        weakref.finalize(kept, ctx.buffers.give_back, *piece)
    ctx.stats.keep(kept.nbytes, kept.on_host)
    return kept


def restore(kept: Kept, ctx: CheckpointingContext) -> torch.Tensor:
    """The whole input on its device again, detached, requiring grad as the original did."""
    data = kept.data
    if data.device != kept.device:
        data = _to_device(data, kept.device, ctx)
    if kept.partitioned:
        mp = ctx.model_parallel
        full = torch.empty(data.numel() * mp.size, dtype=data.dtype, device=kept.device)
        all_gather_into_tensor(full, data.contiguous(), group=mp.group)
        data = full
    numel = 1
    for dim in kept.shape:
        numel *= dim
    out = data.reshape(-1).narrow(0, 0, numel).view(kept.shape).detach()
    if kept.in_piece and kept.data.data_ptr() == out.data_ptr():  # the piece goes to a later forward
        out = out.clone()
    ctx.stats.drop(kept.nbytes, kept.on_host)
    return out.requires_grad_(kept.requires_grad)


def _to_host(data: torch.Tensor, ctx: CheckpointingContext) -> torch.Tensor:
    if data.device.type != "cuda":
        return data.clone()
    stream = ctx.side_stream(data.device)  # [Note: host copies on a side stream]
    stream.wait_stream(torch.cuda.current_stream(data.device))
    with torch.cuda.stream(stream):
        host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
        host.copy_(data, non_blocking=True)
    data.record_stream(stream)
    return host


def _to_device(data: torch.Tensor, device: torch.device, ctx: CheckpointingContext) -> torch.Tensor:
    if device.type != "cuda":
        return data.to(device)
    stream = ctx.side_stream(device)
    with torch.cuda.stream(stream):
        out = data.to(device, non_blocking=True)
    current = torch.cuda.current_stream(device)
    current.wait_stream(stream)
    out.record_stream(current)
    return out
