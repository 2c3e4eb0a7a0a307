"""Flat storage of one parameter group: parameters, master weights and gradients.

[Note: parameter views]
Trainable parameters keep their identity (the user's optimizer, tied weights and hooks still see the
same `nn.Parameter` objects) but their `.data` becomes a view into one flat buffer per group in the
compute dtype. After the optimizer step, a bucket's all-gather writes the updated values straight
into those views: there is no copy-out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from zeroshard.offload.tier import Tier
from zeroshard.zero.flat.local import local_of, rebind
from zeroshard.zero.layout import GroupLayout, owned_pieces


@dataclass
class GroupBuffers:
    """Tensors of one parameter group on one rank."""

    layout: GroupLayout
    params: list[nn.Parameter]  # indexed like the group's parameter list
    param_flat: torch.Tensor  # full group, compute dtype; parameters are views into it
    master: torch.Tensor  # this rank's shard, fp32 or bf16 (aliases param_flat when unsharded and of that dtype)
    grad_shard: torch.Tensor  # this rank's reduced gradients, grad-accumulation dtype
    grad_full: torch.Tensor | None = None  # stage 0/1: local accumulation of full gradients (stage 1: maybe later)
    master_aliases_params: bool = False
    _shapes: dict[int, torch.Size] = field(default_factory=dict)  # the parameters' shapes while they are offloaded

    @property
    def shard_in_accumulator(self) -> bool:
        """Stage 1: the gradient shard is the front of the full accumulator ([Note: stage 1's shard inside its
        accumulator] in reducer.py)."""
        return self.grad_full is not None and self.grad_shard is not self.grad_full

    def add_full_accumulator(self) -> None:
        """Stage 1 with its accumulator on demand: allocate it now, zeroed, and move the gradient shard (its values
        are zeros: no window has been reduced) to its front, keeping the shard's tensor object ([Note: stage 1's
        accumulator on demand] in reducer.py)."""
        assert self.grad_full is None
        full = torch.zeros(self.layout.numel, dtype=self.grad_shard.dtype, device=self.grad_shard.device)
        self.grad_shard.set_(full.untyped_storage(), 0, (self.layout.shard_numel,), (1,))  # type: ignore[call-overload]
        self.grad_full = full

    def bucket_params(self, start: int, numel: int) -> torch.Tensor:
        return self.param_flat.narrow(0, start, numel)

    def show_params(self, away: bool, host_view: Callable[[torch.Tensor], torch.Tensor | None] | None) -> None:
        """While `param_flat` is offloaded the parameters are the same views of its host copy (`host_view`), and its
        views again after ([Note: offloaded states] in offload/states.py)."""
        host = host_view(self.param_flat) if away and host_view is not None else None  # (its storage is empty)
        for slot in self.layout.slots:
            param = self.params[slot.index]
            if away:
                shape = self._shapes[slot.index] = local_of(param).shape
                shown = host.narrow(0, slot.offset, slot.numel).view(shape) if host is not None else None
                rebind(param, shown if shown is not None else self.param_flat.new_empty(0))
            else:
                view = self.param_flat.narrow(0, slot.offset, slot.numel)
                rebind(param, view.view(self._shapes.pop(slot.index)))


def build_group_buffers(
    layout: GroupLayout,
    params: list[nn.Parameter],
    shard_rank: int,
    compute_dtype: torch.dtype,
    grad_accum_dtype: torch.dtype,
    keep_full_grads: bool,
    device: torch.device,
    master_tier: Tier,
    master_dtype: torch.dtype = torch.float32,
) -> GroupBuffers:
    """Allocate a group's buffers, copy the current parameter values in, and rebind the parameters.
    Master weights (`master_dtype`: [Note: bf16 master weights]) live on `master_tier` (the compute device unless
    optimizer state is offloaded)."""
    tier = master_tier
    param_flat = torch.zeros(layout.numel, dtype=compute_dtype, device=device)
    alias = layout.numel == layout.shard_numel and compute_dtype == master_dtype and tier.may_alias_compute()
    master = param_flat if alias else tier.zeros(layout.shard_numel, master_dtype)
    if not alias:
        for piece in owned_pieces(layout, shard_rank):
            source = local_of(params[layout.slots[piece.slot].index]).detach().reshape(-1)
            master.narrow(0, piece.shard_offset, piece.param_end - piece.param_begin).copy_(
                source[piece.param_begin : piece.param_end]
            )
    for slot in layout.slots:
        param = params[slot.index]
        local = local_of(param)  # [Note: DTensor parameters]
        view = param_flat.narrow(0, slot.offset, slot.numel)
        view.copy_(local.detach().reshape(-1))
        rebind(param, view.view(local.shape))
    grad_full = torch.zeros(layout.numel, dtype=grad_accum_dtype, device=device) if keep_full_grads else None
    if grad_full is not None and layout.numel == layout.shard_numel:
        grad_shard = grad_full  # unsharded (stage 0): the reduced full gradient is the shard
    elif grad_full is not None:
        grad_shard = grad_full.narrow(0, 0, layout.shard_numel)  # [Note: stage 1's shard inside its accumulator]
    else:
        grad_shard = torch.zeros(layout.shard_numel, dtype=grad_accum_dtype, device=device)
    return GroupBuffers(layout, params, param_flat, master, grad_shard, grad_full, alias)
