"""Undo one Adam/AdamW step on given tensors: what `super_offload` needs when a step it took during backward turns
out to be a skipped one ([Note: speculative host steps] in zero/stage3/speculate.py).

[Note: undoing an Adam step]
The step being undone ran, per element (torch's Adam/AdamW and `UncorrectedAdam` alike; t is the step count after
it, both corrections 1 without bias correction):

    theta *= 1 - lr * wd                         (decoupled weight decay: AdamW)
    g'     = g + wd * theta                      (L2 weight decay: Adam)
    m      = beta1 * m + (1 - beta1) * g'
    v      = beta2 * v + (1 - beta2) * g' * g'
    theta -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Each line is inverted in float64, last line first, from the values after the step and the gradient it used, then
rounded back to float32 (DeepSpeed's SuperOffload rolls back the same way, in float32). What the step's own float32
rounding lost stays lost: the parameters come back within a few roundings of the larger of themselves and the
update (about lr), but a moment comes back within a rounding of the gradient's term, which is a large relative
error where that term dwarfed the moment (a gradient spike: measured up to 0.4 in m and 3 in v at 1000 times the
usual gradient). A moment that came back from its first step is set to exact zeros, as it was created. Only
optimizers whose update is the one above are accepted (`undoable_reason`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from zeroshard.optim.adam import UncorrectedAdam

CHUNK = 1 << 22  # elements undone at a time: float64 temporaries stay a few tens of MB


def undoable_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why one step of `optimizer` cannot be undone by `undo_adam_step`, or None when it can."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, UncorrectedAdam)):
        return f"the optimizer is {type(optimizer).__name__}, and only Adam and AdamW steps can be undone"
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag, False):
                return f"{type(optimizer).__name__} runs with {flag}=True, whose step cannot be undone"
        if isinstance(group["lr"], torch.Tensor):
            return "the learning rate is a tensor"
    return None


def undo_adam_step(optimizer: torch.optim.Optimizer, stepped: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Undo `optimizer`'s last step on each (parameter, gradient it used) of `stepped` ([Note: undoing an Adam
    step]); the parameters' groups keep the hyperparameters of that step."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    for param, grad in stepped:
        state = optimizer.state.get(param)
        if not state:
            continue  # never stepped
        group = group_of[id(param)]
        t = int(state["step"])
        _undo(param.detach(), grad, state, group, t, _decoupled(optimizer, group), _corrected(optimizer))
        if isinstance(state["step"], torch.Tensor):
            state["step"].sub_(1)
        else:
            state["step"] = t - 1
        if t == 1:
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()


def _decoupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    if isinstance(optimizer, UncorrectedAdam):
        return bool(group["adam_w_mode"])
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


def _corrected(optimizer: torch.optim.Optimizer) -> bool:
    return not isinstance(optimizer, UncorrectedAdam)


def _undo(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
    t: int,
    decoupled: bool,
    corrected: bool,
) -> None:
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    beta1, beta2 = (float(b) for b in group["betas"])
    step_size = lr / (1.0 - beta1**t) if corrected else lr
    correction2_sqrt = math.sqrt(1.0 - beta2**t) if corrected else 1.0
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    flat = [x.view(-1) for x in (param, grad, exp_avg, exp_avg_sq)]
    for lo in range(0, param.numel(), CHUNK):
        p, g, m, v = (x[lo : lo + CHUNK] for x in flat)
        p64, g64, m64, v64 = (x.double() for x in (p, g, m, v))
        p64 += step_size * m64 / (v64.sqrt() / correction2_sqrt + eps)
        if wd != 0.0 and decoupled:
            p64 /= 1.0 - lr * wd
        elif wd != 0.0:
            g64 = g64 + wd * p64
        m.copy_((m64 - (1.0 - beta1) * g64) / beta1 if beta1 > 0.0 else torch.zeros_like(m64))
        v.copy_(((v64 - (1.0 - beta2) * g64 * g64) / beta2).clamp_(min=0.0) if beta2 > 0.0 else torch.zeros_like(v64))
        p.copy_(p64)
