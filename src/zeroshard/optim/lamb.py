"""LAMB: ds_config `"optimizer": {"type": "Lamb"}`, as DeepSpeed 0.19.8's FusedLamb computes it.

For each tensor W with gradient g (DeepSpeed's kernel, `csrc/lamb/fused_lamb_cuda_kernel.cu`):

    m = b1 m + (1 - b1) g                 v = b2 v + (1 - b2) g^2            (elementwise)
    u = m / (sqrt(v) + eps) + weight_decay W                (eps_inside_sqrt: m / sqrt(v + eps) + ...)
    c = clamp(|W| / |u|, min_coeff, max_coeff)             (1 where |W| or |u| is 0)
    W = W - step_size c u,   step_size = lr sqrt(1 - b2^t) / (1 - b1^t)   (lr without bias_correction)

[Note: LAMB on flat shards]
The trust ratio c needs each tensor's whole norms, where ZeRO hands the optimizer flat tensors holding pieces of many
parameters ([Note: elementwise optimizers only] in optimizers.py). The moments and u are elementwise and run on the
shard; the norms ask the optimizer's `NormPlan`, set by the strategy that built the tensors (zero/norms.py: stages 0-2
and the fsdp2 backend's per-parameter rows; zero/stage3/norms.py): which parameter each piece of a flat tensor
belongs to (`segments`), and a sum over the ranks that hold pieces of the same parameters
(`reduce`: one all-reduce of two float64 numbers per parameter and group stepped, nothing at stage 0, where every rank
holds every parameter). Every rank calls it for every group it steps, holding pieces or not, so the all-reduces pair
up; the sums run in float64, so the coefficients equal the single-process optimizer's to rounding. Without a plan
each tensor is its own parameter (the optimizer over ordinary parameters, as in a single process).
Differences from DeepSpeed: none in the step; DeepSpeed's FusedLamb is CUDA-only (a compiled extension), this one
runs wherever torch does; `max_grad_norm` is refused (gradient clipping is the top-level `gradient_clipping` key).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch

from zeroshard.errors import ConfigError
from zeroshard.optim.closure import evaluate

LAMB_KEYS = ("lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_coeff", "min_coeff")


class NormPlan(Protocol):
    """Which parameters the flat tensors a strategy hands the optimizer hold pieces of ([Note: LAMB on flat shards])."""

    def segments(
        self, group: int, stepped: Sequence[torch.Tensor]
    ) -> tuple[int, dict[int, list[tuple[int, int, int]]]]:
        """The number of parameters group `group` steps now on every rank, and for each tensor of `stepped` (by
        `id`) its pieces: (offset in the tensor, length, the parameter's number). The count is the same on every
        rank; 0: nothing to step, and no `reduce`."""
        ...

    def reduce(self, sums: torch.Tensor) -> None:
        """`sums` (float64, one column per parameter) summed over the ranks holding pieces, in place. Collective."""
        ...


class Lamb(torch.optim.Optimizer):
    """DeepSpeed's FusedLamb step (module docstring), on any device.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(4))
        >>> opt = Lamb([w], lr=0.1)
        >>> w.grad = torch.ones(4)
        >>> _ = opt.step()
        >>> round(w[0].item(), 4)  # u = 3.16 per element, c = |W| / |u| = 2 / 6.32, step_size = 0.0316
        0.9684
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb does not support the AMSGrad variant (as DeepSpeed's FusedLamb)")
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"Lamb: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {betas}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb: need 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.plan: NormPlan | None = None  # set by the strategy that built the flat tensors (attach)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = evaluate(closure)
        for index, group in enumerate(self.param_groups):
            self._step_group(index, group)
        return loss

    def _step_group(self, index: int, group: dict[str, Any]) -> None:
        stepped = [p for p in group["params"] if p.grad is not None]
        if self.plan is not None:
            count, segments = self.plan.segments(index, stepped)
        else:  # ordinary parameters: each is its own
            count, segments = len(stepped), {id(p): [(0, p.numel(), k)] for k, p in enumerate(stepped)}
        if count == 0:
            return
        beta1, beta2 = group["betas"]
        device = stepped[0].device if stepped else torch.device("cpu")
        sums = torch.zeros(2, count, dtype=torch.float64)  # |W|^2 and |u|^2 per parameter, summed on the host
        updates: dict[int, torch.Tensor] = {}
        steps: dict[int, int] = {}
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # (weights, update) of each segment, in plan order
        ks: list[int] = []
        for param in stepped:
            grad = param.grad
            assert grad is not None
            state = self.state[param]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            state["step"] += 1
            steps[id(param)] = state["step"]
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if group["eps_inside_sqrt"]:
                denom = exp_avg_sq.add(group["eps"]).sqrt_()
            else:
                denom = exp_avg_sq.sqrt().add_(group["eps"])
            update = torch.div(exp_avg, denom, out=denom)  # one temporary the size of the tensor, not two
            if group["weight_decay"]:
                update.add_(param, alpha=group["weight_decay"])
            updates[id(param)] = update
            flat, flat_update = param.view(-1), update.view(-1)
            if param.numel() and id(param) not in segments:  # a plan that does not know a tensor would not step it
                raise RuntimeError(f"Lamb: the plan names no parameter of a stepped tensor of group {index}")
            for offset, length, k in segments.get(id(param), []):
                pieces.append((flat.narrow(0, offset, length), flat_update.narrow(0, offset, length)))
                ks.append(k)
        if ks:  # one call per device for all segments (a few kernels per segment cost 30% of a 400-segment step)
            # a parameter's segments are added on the host, in order: CUDA's index_add_ adds repeated indices with
            # atomics, in any order (float64 sums then differ in their last bits from run to run); the coefficients
            # are read on the host below anyway
            at = torch.tensor(ks)
            squares = torch.stack([_squares([w for w, _ in pieces], device), _squares([u for _, u in pieces], device)])
            sums.index_add_(1, at, squares.cpu())  # one device-to-host copy
        if self.plan is not None:  # all-reduced over the ranks' device group
            sums = sums.to(device)
            self.plan.reduce(sums)
        norms = sums.sqrt()
        ratio = (norms[0] / norms[1]).clamp(group["min_coeff"], group["max_coeff"])
        coeff = torch.where((norms[0] > 0) & (norms[1] > 0), ratio, torch.ones_like(ratio)).tolist()
        for param in stepped:
            step_size = group["lr"]
            if group["bias_correction"]:
                t = steps[id(param)]
                step_size *= math.sqrt(1 - beta2**t) / (1 - beta1**t)
            flat, flat_update = param.view(-1), updates[id(param)].view(-1)
            for offset, length, k in segments.get(id(param), []):
                flat.narrow(0, offset, length).add_(flat_update.narrow(0, offset, length), alpha=-step_size * coeff[k])


def _squares(views: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Each view's sum of squares in float64, on `device` (torch's foreach norm per device the views are on: on the CPU
    the same kernel as `vector_norm`, without a Python call per view)."""
    out = torch.empty(len(views), dtype=torch.float64, device=device)
    by_device: dict[torch.device, list[int]] = {}
    for i, view in enumerate(views):
        by_device.setdefault(view.device, []).append(i)
    for positions in by_device.values():
        norms = torch._foreach_norm([views[i] for i in positions], 2, dtype=torch.float64)
        out[torch.tensor(positions, device=device)] = torch.stack(norms).square().to(device)
    return out


def refuse_unplanned(optimizer: torch.optim.Optimizer, where: str) -> None:
    """A ConfigError when `optimizer` is LAMB and the strategy `where` describes has no `NormPlan` for it."""
    if isinstance(optimizer, Lamb):
        raise ConfigError(
            f"optimizer.type Lamb is not supported with {where}: its trust ratio needs each parameter's whole norms, "
            "which that strategy does not plan ([Note: LAMB on flat shards] in optim/lamb.py); train LAMB with the "
            "zero backend (stages 0-3) without tensor parallelism or MoE experts, or choose another optimizer"
        )
