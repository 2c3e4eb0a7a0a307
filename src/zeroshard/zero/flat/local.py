"""The tensor a flat buffer holds for a parameter: the parameter itself, or a DTensor's local shard.

[Note: DTensor parameters]
With tensor parallelism (zeroshard/tp/) the module's parameters are DTensors over the tensor-parallel mesh
dimension: each rank computes with its local shard, and autograd leaves a DTensor gradient with the same
placements. Stages 0-2 treat that local shard as the parameter: its numel sizes the layout, the flat buffer's view
becomes the DTensor's local tensor (the DTensor object, its placements and its identity stay, so DTensor's forward
and the optimizer's bookkeeping see the same parameter), and the local part of the gradient is what is reduced over
the data-parallel group. ZeRO therefore shards each tensor-parallel rank's own slice over its data-parallel peers;
nothing here talks to the tensor-parallel group (the norm's sum over it is the step policy's `model_parallel`).

[Note: sparse gradients]
A sparse gradient (`nn.Embedding(sparse=True)`) is made dense when it arrives (`local_grad`, and stage 3's
staging): flat buffers and shards hold dense gradients, so the optimizer steps the same values a dense gradient
would give, and the reduction sends the whole tensor. DeepSpeed's `sparse_gradients` (stage 0 only: all-gather the
touched rows instead) is not implemented.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Without importing DTensor (0.8 s of imports, paid by every rank at start-up): a DTensor exists only once its
    module has been imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else the tensor itself."""
    if is_dtensor(tensor):
        local: torch.Tensor = tensor._local_tensor
        return local
    return tensor


def rebind(param: nn.Parameter, view: torch.Tensor) -> None:
    """`param`'s storage becomes `view` (shaped like its local tensor): [Note: parameter views]."""
    if is_dtensor(param):
        param._local_tensor = view
    else:
        param.data = view


def local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The local part of `grad` laid out as `param`'s local tensor (a DTensor gradient in the parameter's
    placements; another layout is redistributed first), dense ([Note: sparse gradients])."""
    if grad.is_sparse:
        return grad.to_dense()
    if not is_dtensor(grad):
        return grad
    assert is_dtensor(param)
    if grad.placements != param.placements:
        grad = grad.redistribute(param.device_mesh, param.placements)
    return local_of(grad)
