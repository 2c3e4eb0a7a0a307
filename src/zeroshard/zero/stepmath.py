"""The arithmetic every strategy does at the step: overflow check, global norm, one combined scale."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ZeroshardError


@dataclass(frozen=True)
class StepPolicy:
    """How gradients become the update, decided once from the config (shared by every stage).

    [Note: skipped steps]
    `check_overflow` (fp16; bf16 with `check_grad_overflow`, DeepSpeed's default) exchanges every rank's inf/nan
    flag before the norm, as DeepSpeed's loss-scaled and bf16 optimizers do. `skip_nonfinite_norm` also skips a
    step whose global norm is inf/nan, which costs no collective (the norm is all-reduced anyway): DeepSpeed's
    ZeRO optimizers do that in fp32, and in bf16 at stages 0 and 3 whatever `check_grad_overflow` says (DeepSpeed
    0.19.8's bf16 optimizer and stage 3 always skip); bf16 at stages 1-2 with `check_grad_overflow: false` applies
    such a step (DeepSpeed's stage 1-2 optimizer), except at stage 1 with `data_types.grad_accum_dtype` fp32 and
    no optimizer offload (DeepSpeed's BF16_Optimizer there), and so does stage 0 in fp32 (DDP's semantics).
    """

    gradient_clipping: float
    prescale_gradients: bool
    gradient_predivide_factor: float
    check_overflow: bool
    skip_nonfinite_norm: bool = False
    # the ranks across which the model itself is split (pipeline stages): the squared norm and the inf/nan flag
    # are also summed over them, so clipping sees the whole model's norm ([Note: pipeline step])
    model_parallel: Collectives | None = None
    sum_over_ranks: bool = False  # gradient_allreduce_op "sum" (stages 0-2)
    # zero_optimization.compute_grad_norm (stages 1-2, no clipping, no optimizer offload: config/checks.py): false
    # skips the norms and their all-reduce; the step's norm is then None and a non-finite one cannot skip a step
    # (DeepSpeed's stage 1-2 optimizer: only the inf/nan check of `check_overflow` can)
    compute_norm: bool = True
    # the sequence-parallel degree: ZeRO reduces over every rank, but the ranks of one sequence-parallel group
    # hold parts of one sample, so the mean is over world_size / this ([Note: sequence parallelism])
    sequence_parallel: int = 1

    # [Note: pre- and post-scaling] As DeepSpeed's engine (stage 0) and ZeRO optimizers: `prescale_gradients`
    # divides by the world size before the reduction (and ignores gradient_predivide_factor); otherwise the
    # gradients are divided by gradient_predivide_factor before it and by world_size / factor after it. With
    # `gradient_allreduce_op: "sum"` nothing is divided: the step sees the sum over ranks of each rank's gradient
    # (DeepSpeed skips both scalings then, whatever the two keys say). With sequence parallelism "the world size"
    # is the number of data-parallel replicas, world_size / sequence_parallel, as DeepSpeed divides.
    def prescale(self, world_size: int) -> float:
        """Gradients are multiplied by this before they are communicated ([Note: pre- and post-scaling])."""
        if self.sum_over_ranks:
            return 1.0
        return 1.0 / self._replicas(world_size) if self.prescale_gradients else 1.0 / self.gradient_predivide_factor

    def post_scale(self, world_size: int) -> float:
        """Turns the reduced sums into means over ranks, or leaves them sums ([Note: pre- and post-scaling])."""
        if self.sum_over_ranks:
            return 1.0
        return 1.0 if self.prescale_gradients else self.gradient_predivide_factor / self._replicas(world_size)

    def _replicas(self, world_size: int) -> float:
        return world_size / self.sequence_parallel if self.sequence_parallel > 1 else world_size


@dataclass(frozen=True)
class StepScale:
    overflow: bool
    grad_norm: float | None  # of the true (averaged, unscaled) gradients, before clipping
    scale: float  # multiply the raw gradient shards by this before the optimizer step


def tensor_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The per-tensor fp32 2-norms `scale_from_norms` combines (also computed early, tensor by tensor, when the
    gradients leave memory before the step: NVMe offload)."""
    return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads if g.numel() > 0]


def scale_from_norms(
    norms: list[torch.Tensor],
    overflow: bool,
    comm: Collectives,
    sharded: bool,
    loss_scale: float,
    policy: StepPolicy,
    device: torch.device,
) -> StepScale:
    """The step's decision from the gradients' per-tensor norms (summed over ranks, of pre-scaled, loss-scaled
    gradients) and this rank's inf/nan flag."""
    if policy.check_overflow:
        overflow = comm.any_true(overflow, device)
        if policy.model_parallel is not None:  # every stage takes the same decision
            overflow = policy.model_parallel.any_true(overflow, device)
        if overflow:
            return StepScale(True, None, 0.0)
    scale = policy.post_scale(comm.world_size) / loss_scale
    if not policy.compute_norm:
        return StepScale(False, None, scale)
    norm = _global_norm(norms, comm, sharded, device, policy.model_parallel) * scale
    if policy.skip_nonfinite_norm and not math.isfinite(norm):
        return StepScale(True, None, 0.0)
    if policy.gradient_clipping > 0:
        clip_coef = policy.gradient_clipping / (norm + 1e-6)
        if clip_coef < 1.0:
            scale *= clip_coef
    return StepScale(False, norm, scale)


def _global_norm(
    norms: list[torch.Tensor],
    comm: Collectives,
    sharded: bool,
    device: torch.device,
    model_parallel: Collectives | None,
) -> float:
    if norms:
        total_sq = torch.stack(norms).pow(2).sum().reshape(1)
    else:
        total_sq = torch.zeros(1, device=device)
    if sharded:
        comm.all_reduce(total_sq)
    if model_parallel is not None:
        model_parallel.all_reduce(total_sq, label="step.norm_across_stages")
    return math.sqrt(float(total_sq.item()))


def shard_gradient(value: torch.Tensor, numel: int, dtype: torch.dtype, scale: float, call: str) -> torch.Tensor:
    """A gradient in `full_grad`'s terms (of `numel` elements, else a one-line error naming `call`) as a shard of
    `dtype` holds it: divided by the step's `scale`, rounded to `dtype` wherever it is written (a host copy in fp32
    too), returned in fp32 ([Note: setting a gradient] in offload/gradients.py)."""
    if value.numel() != numel:
        raise ZeroshardError(f"{call}: the gradient has {numel} elements; the value given has {value.numel()}")
    value = value.detach().to(torch.float32)
    return (value / scale if scale != 1.0 else value).to(dtype).to(torch.float32)
