"""Adam/AdamW without bias correction: ds_config `"optimizer": {"type": "Adam", "params": {"bias_correction": false}}`.

torch's Adam always divides the moments by (1 - beta^t); DeepSpeed's FusedAdam and DeepSpeedCPUAdam take a
`bias_correction` flag, and with it false they use the raw moments (their kernels set both corrections to 1):

    g      = g + weight_decay * theta                       (L2 mode only: adam_w_mode false)
    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g * g
    theta  = theta * (1 - lr * weight_decay)                (AdamW mode only)
    theta  = theta - lr * m / (sqrt(v) + eps)

The arithmetic is torch's Adam with both corrections equal to 1 (its operations, in its order), so this class
only exists for the flag; with bias correction on, `build_optimizer` keeps torch's fused Adam/AdamW. The update
is elementwise, so it is valid on ZeRO's flat shards ([Note: elementwise optimizers only]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zeroshard.optim.closure import evaluate


class UncorrectedAdam(torch.optim.Optimizer):
    """Adam (L2 weight decay) or AdamW (decoupled) whose moments are not bias-corrected.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> opt = UncorrectedAdam([w], lr=0.1, betas=(0.5, 0.75), eps=0.0)
        >>> w.grad = torch.tensor([1.0, -1.0])
        >>> _ = opt.step()
        >>> w.detach().tolist()  # -lr * (0.5 g) / sqrt(0.25 g^2) = -lr * sign(g)
        [-0.10000000149011612, 0.10000000149011612]
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adam_w_mode: bool = True,
    ) -> None:
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"UncorrectedAdam: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"UncorrectedAdam: betas must be two values in [0, 1), got {betas}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_w_mode": adam_w_mode,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Apply one update to every parameter that has a gradient."""
        loss = evaluate(closure)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("UncorrectedAdam does not support sparse gradients")
                self._update(param, self._state_of(param), group)
        return loss

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        return state

    @staticmethod
    def _update(param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        grad = param.grad
        assert grad is not None
        if weight_decay != 0.0:
            if group["adam_w_mode"]:
                param.mul_(1.0 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        param.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(eps), value=-lr)
