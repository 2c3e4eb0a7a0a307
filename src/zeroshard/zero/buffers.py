"""Flat storage of one parameter group: parameters, master weights and gradients.

[Note: parameter views]
Trainable parameters keep their identity (the user's optimizer, tied weights and hooks still see the
same `nn.Parameter` objects) but their `.data` becomes a view into one flat buffer per group in the
compute dtype. After the optimizer step, a bucket's all-gather writes the updated values straight
into those views: there is no copy-out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from zeroshard.offload.tier import Tier
from zeroshard.zero.layout import GroupLayout, owned_pieces


@dataclass
class GroupBuffers:
    """Tensors of one parameter group on one rank."""

    layout: GroupLayout
    params: list[nn.Parameter]  # indexed like the group's parameter list
    param_flat: torch.Tensor  # full group, compute dtype; parameters are views into it
    master: torch.Tensor  # this rank's shard, fp32 (aliases param_flat when that is already fp32 and unsharded)
    grad_shard: torch.Tensor  # this rank's reduced gradients, grad-accumulation dtype
    grad_full: torch.Tensor | None = None  # stage 0/1: local accumulation of full gradients
    master_aliases_params: bool = False
    grad_views: list[torch.Tensor] = field(default_factory=list)  # per slot, into grad_full

    def param_view(self, slot_index: int) -> torch.Tensor:
        slot = self.layout.slots[slot_index]
        return self.param_flat.narrow(0, slot.offset, slot.numel)

    def bucket_params(self, start: int, numel: int) -> torch.Tensor:
        return self.param_flat.narrow(0, start, numel)


def build_group_buffers(
    layout: GroupLayout,
    params: list[nn.Parameter],
    shard_rank: int,
    compute_dtype: torch.dtype,
    grad_accum_dtype: torch.dtype,
    keep_full_grads: bool,
    device: torch.device,
    master_tier: Tier | None = None,
) -> GroupBuffers:
    """Allocate a group's buffers, copy the current parameter values in, and rebind the parameters.
    Master weights live on `master_tier` (the compute device unless optimizer state is offloaded)."""
    tier = master_tier or Tier("device", device)
    param_flat = torch.zeros(layout.numel, dtype=compute_dtype, device=device)
    alias = layout.numel == layout.shard_numel and compute_dtype == torch.float32 and not tier.offloaded
    master = param_flat if alias else tier.zeros(layout.shard_numel)
    if not alias:
        for piece in owned_pieces(layout, shard_rank):
            source = params[layout.slots[piece.slot].index].detach().reshape(-1)
            master.narrow(0, piece.shard_offset, piece.param_end - piece.param_begin).copy_(
                source[piece.param_begin : piece.param_end]
            )
    for slot in layout.slots:
        param = params[slot.index]
        view = param_flat.narrow(0, slot.offset, slot.numel)
        view.copy_(param.detach().reshape(-1))
        param.data = view.view(param.shape)
    grad_full = torch.zeros(layout.numel, dtype=grad_accum_dtype, device=device) if keep_full_grads else None
    if grad_full is not None and layout.numel == layout.shard_numel:
        grad_shard = grad_full  # unsharded (stage 0): the reduced full gradient is the shard
    else:
        grad_shard = torch.zeros(layout.shard_numel, dtype=grad_accum_dtype, device=device)
    buffers = GroupBuffers(layout, params, param_flat, master, grad_shard, grad_full, alias)
    if grad_full is not None:
        buffers.grad_views = [grad_full.narrow(0, s.offset, s.numel) for s in layout.slots]
    return buffers


class BufferPool:
    """Reusable communication buffers keyed by (numel, dtype): no allocator round trip per bucket."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._in_use_bytes = 0
        self.peak_bytes = 0

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        stack = self._free.get((numel, dtype))
        tensor = stack.pop() if stack else torch.empty(numel, dtype=dtype, device=self.device)
        self._in_use_bytes += tensor.numel() * tensor.element_size()
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return tensor.zero_()

    def release(self, tensor: torch.Tensor) -> None:
        self._in_use_bytes -= tensor.numel() * tensor.element_size()
        self._free.setdefault((tensor.numel(), tensor.dtype), []).append(tensor)

    @property
    def held_bytes(self) -> int:
        free = sum(t.numel() * t.element_size() for stack in self._free.values() for t in stack)
        return free + self._in_use_bytes

    def clear(self) -> None:
        self._free.clear()


def cast_floating_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers follow the compute dtype, as DeepSpeed's module cast does."""
    for submodule in module.modules():
        for name, buf in submodule.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                setattr(submodule, name, buf.to(dtype))
