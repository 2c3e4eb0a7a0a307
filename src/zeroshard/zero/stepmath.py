"""The arithmetic every strategy does at the step: overflow check, global norm, one combined scale."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.precision.loss_scaler import has_inf_or_nan


@dataclass(frozen=True)
class StepScale:
    overflow: bool
    grad_norm: float | None  # of the true (averaged, unscaled) gradients, before clipping
    scale: float  # multiply the raw gradient shards by this before the optimizer step


def step_scale(
    grads: list[torch.Tensor],
    comm: Collectives,
    sharded: bool,
    post_scale: float,
    loss_scale: float,
    clip: float,
    check_overflow: bool,
    device: torch.device,
) -> StepScale:
    """`grads` hold sums over ranks (of pre-scaled, loss-scaled gradients); `post_scale` makes them means."""
    overflow = check_overflow and has_inf_or_nan(grads)
    return scale_from_norms(
        tensor_norms(grads), overflow, comm, sharded, post_scale, loss_scale, clip, check_overflow, device
    )


def tensor_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The per-tensor fp32 2-norms `scale_from_norms` combines (also computed early, tensor by tensor, when the
    gradients leave memory before the step: NVMe offload)."""
    return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads if g.numel() > 0]


def scale_from_norms(
    norms: list[torch.Tensor],
    overflow: bool,
    comm: Collectives,
    sharded: bool,
    post_scale: float,
    loss_scale: float,
    clip: float,
    check_overflow: bool,
    device: torch.device,
) -> StepScale:
    """`step_scale` from the gradients' per-tensor norms and this rank's overflow flag."""
    if check_overflow and comm.any_true(overflow, device):
        return StepScale(True, None, 0.0)
    scale = post_scale / loss_scale
    norm = _global_norm(norms, comm, sharded, device) * scale
    if clip > 0:
        clip_coef = clip / (norm + 1e-6)
        if clip_coef < 1.0:
            scale *= clip_coef
    return StepScale(False, norm, scale)


def global_norm(grads: list[torch.Tensor], comm: Collectives, sharded: bool, device: torch.device) -> float:
    return _global_norm(tensor_norms(grads), comm, sharded, device)


def _global_norm(norms: list[torch.Tensor], comm: Collectives, sharded: bool, device: torch.device) -> float:
    if norms:
        total_sq = torch.stack(norms).pow(2).sum().reshape(1)
    else:
        total_sq = torch.zeros(1, device=device)
    if sharded:
        comm.all_reduce(total_sq)
    return math.sqrt(float(total_sq.item()))
