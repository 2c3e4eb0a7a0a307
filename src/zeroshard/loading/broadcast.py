"""The start every rank of an engine shares: the first rank's parameters and buffers, broadcast at `initialize`."""

from __future__ import annotations

from torch import nn

from zeroshard.comm.collectives import Collectives
from zeroshard.zero.flat.local import local_of

BROADCAST_BUCKET = 1 << 28  # bytes per flat broadcast of whole parameters: not a second model on the device


def broadcast_module_state(module: nn.Module, comm: Collectives, src: int = 0) -> None:
    """Every rank starts from the group's first rank's (global rank `src`) parameters and buffers (as DDP and
    DeepSpeed do); MoE experts from the first rank of their expert-data-parallel group ([Note: expert groups] in
    moe/groups.py)."""
    if comm.world_size == 1:
        return
    from zeroshard.moe.zero import moe_layers

    experts = {id(p) for layer in moe_layers(module) for p in layer.expert_parameters()}
    for layer in moe_layers(module):
        layer.groups.broadcast_experts(layer.expert_parameters())
    # a tensor-parallel parameter's local slice, synced with its data-parallel peers ([Note: DTensor parameters]);
    # not DeepSpeed's rank-local `ds_optim_param`s ([Note: sharded base weights] in linear/optimized_linear.py)
    skip = experts | {id(t) for t in module.parameters() if getattr(t, "ds_optim_param", False)}
    tensors = [local_of(t).data for t in module.parameters() if id(t) not in skip] + list(module.buffers())
    comm.broadcast_coalesced(tensors, src=src, bucket_bytes=BROADCAST_BUCKET)
