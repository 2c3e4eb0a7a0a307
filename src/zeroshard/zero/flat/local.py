"""The tensor a flat buffer holds for a parameter: the parameter itself, or a DTensor's local shard.

[Note: DTensor parameters]
With tensor parallelism (zeroshard/tp/) the module's parameters are DTensors over the tensor-parallel mesh
dimension: each rank computes with its local shard, and autograd leaves a DTensor gradient with the same
placements. Stages 0-2 treat that local shard as the parameter: its numel sizes the layout, the flat buffer's view
becomes the DTensor's local tensor (the DTensor object, its placements and its identity stay, so DTensor's forward
and the optimizer's bookkeeping see the same parameter), and the local part of the gradient is what is reduced over
the data-parallel group. ZeRO therefore shards each tensor-parallel rank's own slice over its data-parallel peers;
nothing here talks to the tensor-parallel group (the norm's sum over it is the step policy's `model_parallel`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else the tensor itself."""
    if isinstance(tensor, DTensor):
        local: torch.Tensor = tensor._local_tensor
        return local
    return tensor


def rebind(param: nn.Parameter, view: torch.Tensor) -> None:
    """`param`'s storage becomes `view` (shaped like its local tensor): [Note: parameter views]."""
    if isinstance(param, DTensor):
        param._local_tensor = view
    else:
        param.data = view


def local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The local part of `grad` laid out as `param`'s local tensor (a DTensor gradient in the parameter's
    placements; another layout is redistributed first)."""
    if not isinstance(grad, DTensor):
        return grad
    assert isinstance(param, DTensor)
    if grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local_of(grad)
