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
    if check_overflow and comm.any_true(has_inf_or_nan(grads), device):
        return StepScale(True, None, 0.0)
    scale = post_scale / loss_scale
    norm = global_norm(grads, comm, sharded, device) * scale
    if clip > 0:
        clip_coef = clip / (norm + 1e-6)
        if clip_coef < 1.0:
            scale *= clip_coef
    return StepScale(False, norm, scale)


def global_norm(grads: list[torch.Tensor], comm: Collectives, sharded: bool, device: torch.device) -> float:
    nonempty = [g for g in grads if g.numel() > 0]
    if nonempty:
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in nonempty])
        total_sq = norms.pow(2).sum().reshape(1)
    else:
        total_sq = torch.zeros(1, device=device)
    if sharded:
        comm.all_reduce(total_sq)
    return math.sqrt(float(total_sq.item()))
