"""`deepspeed.moe.mappings`: tokens split over the tensor-parallel ranks and gathered back, differentiable.

Under tensor parallelism every rank of a tensor-parallel group holds the same tokens between the split layers.
Megatron-DeepSpeed's MoE with tensor parallelism routes only this rank's share of them through the gate and the
experts (`drop_tokens`: 1/tp of a dimension, the slice at this rank's position) and puts the experts' outputs back
together (`gather_tokens`: every rank's slice, concatenated in rank order). Each is the other's backward: a gather's
gradient is this rank's slice of the output's gradient, a drop's is every rank's slice of it gathered.

The group is that of the mpu a script put at `zeroshard.utils.groups.mpu` (where DeepSpeed's engine puts the mpu
`initialize` was given), read through `zeroshard.utils.bwc`; without one, the tensor-parallel group of the engine
built last ([Note: groups follow the engine] in utils/groups.py): its mpu's or AutoTP's. With one tensor-parallel
rank, or none, the input comes back as it is. The group is read when the forward runs; the backward uses the same.

Example:
    >>> x = torch.ones(4, 3)
    >>> gather_tokens(x) is x  # no tensor parallelism here
    True
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.utils import groups
from zeroshard.utils.bwc import (
    bwc_tensor_model_parallel_group,
    bwc_tensor_model_parallel_rank,
    bwc_tensor_model_parallel_world_size,
)


def _tensor_parallel() -> Collectives | None:
    """Collectives over the tensor-parallel group (module docstring); None with one rank: nothing to split."""
    mpu = getattr(groups, "mpu", None)
    if mpu is None:
        mpu = groups  # the module answers an mpu's tensor-parallel methods for the engine built last
    world_size = bwc_tensor_model_parallel_world_size(mpu)
    if world_size == 1:
        return None
    return Collectives(bwc_tensor_model_parallel_group(mpu), world_size, bwc_tensor_model_parallel_rank(mpu))


def _gather(comm: Collectives, input_: torch.Tensor, dim: int) -> torch.Tensor:
    """Every rank's `input_` concatenated along `dim`, in rank order."""
    input_ = input_.contiguous()
    gathered = input_.new_empty((comm.world_size, *input_.shape))
    comm.all_gather(gathered, input_, label="moe.gather_tokens")
    if dim == 0:
        return gathered.flatten(0, 1)
    return torch.cat(gathered.unbind(0), dim=dim)


def _drop(comm: Collectives, input_: torch.Tensor, dim: int) -> torch.Tensor:
    """This rank's slice of `dim` (a view of `input_`), which must split evenly over the group."""
    size, parts = input_.shape[dim], comm.world_size
    if size % parts:
        raise ValueError(
            f"drop_tokens: dimension {dim} has {size} elements, which do not split over {parts} tensor-parallel "
            f"ranks; pad it to a multiple of {parts}"
        )
    chunk = size // parts
    return input_.narrow(dim, comm.rank * chunk, chunk)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, comm: Collectives, input_: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _gather(comm, input_, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        return None, _drop(ctx.comm, grad, ctx.dim), None


class _DropTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, comm: Collectives, input_: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _drop(comm, input_, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        return None, _gather(ctx.comm, grad, ctx.dim), None


def gather_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Every tensor-parallel rank's `input_` concatenated along `dim` in rank order (the input itself with one
    rank); the gradient is this rank's slice of the output's gradient. A collective: every rank of the group calls
    it, with inputs of one shape."""
    comm = _tensor_parallel()
    return input_ if comm is None else _GatherTokens.apply(comm, input_, dim)


def drop_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This tensor-parallel rank's slice of `dim` (rank r of tp: the r-th of tp equal slices; the input itself with
    one rank); a ValueError if `dim` does not split evenly. The gradient is every rank's slice of the gradient
    gathered, so the backward is a collective: every rank of the group calls it."""
    comm = _tensor_parallel()
    return input_ if comm is None else _DropTokens.apply(comm, input_, dim)
