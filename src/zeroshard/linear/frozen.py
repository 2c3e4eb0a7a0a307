"""A linear map by a frozen weight that is rebuilt for each use and not kept for backward.

[Note: frozen weights rebuilt in backward]
`OptimizedLinear`'s base weight is frozen and held in a reduced form: a shard of it (the ranks gather the rest), or
quantized bytes, or both. DeepSpeed builds the whole bf16 weight in the forward and hands it to `F.linear`, whose
autograd keeps it until the backward: every layer's whole base weight is then alive from its forward to its
backward, as if it were not reduced. `frozen_linear` keeps only the way to rebuild it (the layer) and rebuilds the
weight in the backward (one more gather, or dequantization, per layer): between the passes a layer holds its reduced
form only. The input's gradient is `grad @ weight` and the bias's the sum of `grad` over the rows, in `grad`'s dtype
(the weight cast to it under autocast, as autocast's `F.linear` casts it), so the results are `F.linear`'s under
autograd bit for bit for contiguous inputs (a transposed 2-D input's gradient may differ in the last bits: torch
computes that one in another layout). The backward is differentiable (`create_graph`). With sharded weights the
gather in the backward is a collective, so every rank must back-propagate through the same sharded layers in the same
order, as ZeRO-3 requires of every layer; `LoRAConfig(regather_in_backward=False)` keeps the gathered weight for the
backward instead, as DeepSpeed does, where the ranks' graphs differ (a head used on some ranks only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


class _FrozenLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, rebuild: Callable[[], torch.Tensor]) -> Any:
        ctx.rebuild, ctx.has_bias = rebuild, bias is not None
        with torch.no_grad():
            return F.linear(x, rebuild(), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad_x = None
        if ctx.needs_input_grad[0]:
            with torch.no_grad():
                weight = ctx.rebuild().to(grad.dtype)
            grad_x = grad.matmul(weight)  # autograd casts it to the input's dtype
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_x, grad_bias, None


def frozen_linear(
    x: torch.Tensor, rebuild: Callable[[], torch.Tensor], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, rebuild(), bias)` with the weight rebuilt in backward ([Note: frozen weights rebuilt in backward]).
    Every rank calls `rebuild` as often as the others (a gather inside it is a collective).

    Example:
        >>> w = torch.randn(3, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> frozen_linear(x, lambda: w).sum().backward()
        >>> torch.equal(x.grad, torch.ones(2, 3) @ w)
        True
    """
    return _FrozenLinear.apply(x, bias, rebuild)
