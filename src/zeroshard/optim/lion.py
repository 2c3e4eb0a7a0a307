"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") vectorised with _foreach ops.

torch ships no Lion, and DeepSpeed's FusedLion/CPU Lion are compiled extensions. The update is elementwise,
so it is valid on the flat fp32 shards the ZeRO engine hands to its optimizer:

    c      = beta1 * m + (1 - beta1) * g
    theta  = theta * (1 - lr * weight_decay) - lr * sign(c)
    m      = beta2 * m + (1 - beta2) * g

[Note: sign of zero] Chen et al. use sign(0) = 0, and so do we. DeepSpeed's kernels never return 0 (CUDA:
`c > 0 ? -lr : lr`; CPU: `-copysign(lr, c)`), so an element whose gradient and momentum are both exactly
zero (padding, unused embedding rows) drifts by lr per step there and stays put here. For every c != 0 the
two agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zeroshard.optim.closure import evaluate


class Lion(torch.optim.Optimizer):
    """Lion optimizer with decoupled weight decay; defaults are DeepSpeed's (lr 1e-3, betas (0.9, 0.999)).

    Example:
        >>> import torch
        >>> from zeroshard.optim.lion import Lion
        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> opt = Lion([w], lr=0.1)
        >>> w.grad = torch.tensor([1.0, -1.0, 0.0])
        >>> _ = opt.step()
        >>> w.detach().tolist()
        [0.8999999761581421, 1.100000023841858, 1.0]
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas must be two values in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one Lion update to every parameter that has a gradient."""
        loss = evaluate(closure)
        for group in self.param_groups:
            params, grads, moments = self._gather(group)
            if params:
                beta1, beta2 = group["betas"]
                _lion_update(params, grads, moments, group["lr"], beta1, beta2, group["weight_decay"])
        return loss

    def _gather(self, group: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """The group's parameters with gradients, their gradients and momenta (created lazily)."""
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        moments: list[torch.Tensor] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Lion does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            params.append(p)
            grads.append(p.grad)
            moments.append(state["exp_avg"])
        return params, grads, moments


def _lion_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    moments: list[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """The Lion step on lists of same-shaped tensors, a handful of multi-tensor kernels in all."""
    direction = torch._foreach_mul(moments, beta1)
    torch._foreach_add_(direction, grads, alpha=1.0 - beta1)
    torch._foreach_sign_(direction)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_mul_(moments, beta2)
    torch._foreach_add_(moments, grads, alpha=1.0 - beta2)
