"""DeepSpeed's `deepspeed.moe.sharded_moe` functions: the gates as it calls them, returning its 4-tuple
`(l_aux, combine_weights, dispatch_mask, exp_counts)` ([Note: gating] in gating.py computes them; DeepSpeed 0.19.8's
values to the bit from the same generator state), `gumbel_rsample` and the `_AllToAll` autograd function.

Differences: `exp_counts` is on the CPU (DeepSpeed's on the logits' device); `use_tutel=True` and `sparse_routes=True`
(DeepSpeed's Tutel kernels and its sparse dispatch format) are refused in one line; the layer, `MoE`, is
`zeroshard.moe.layer.MoE`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zeroshard.moe.gating import GateOutput, gumbel
from zeroshard.moe.gating import top1gating as _top1
from zeroshard.moe.gating import top2gating as _top2
from zeroshard.moe.gating import topkgating as _topk

TUTEL_INSTALLED = False  # (no Tutel kernels: `use_tutel=True` is refused)

Gated = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def gumbel_rsample(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise of `shape`, as DeepSpeed draws it."""
    return gumbel(torch.Size(shape), device)


class _AllToAll(torch.autograd.Function):
    """An all-to-all of equal splits over `group` whose backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup | None, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        dist.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, _AllToAll.apply(ctx.group, *grad_output)


def _refuse(sparse_routes: bool, use_tutel: bool = False) -> None:
    if sparse_routes:
        raise ValueError("sparse_routes=True: DeepSpeed's sparse dispatch format is not provided; use the dense one")
    if use_tutel:
        raise ValueError("use_tutel=True: zeroshard has no Tutel kernels; use_tutel=False gives the same math")


def _tuple(
    out: GateOutput, drop_tokens: bool, ep_group: dist.ProcessGroup | None, at_most_tokens: bool = False
) -> Gated:
    """DeepSpeed's tuple; without dropping, the capacity is the largest over `ep_group` (DeepSpeed's all-reduce: its
    all-to-all takes equal splits; top-1 caps it at the token count), the slots past this rank's own are empty."""
    combine = out.combine
    if not drop_tokens and ep_group is not None and dist.get_world_size(ep_group) > 1:
        capacity = torch.tensor([out.capacity], dtype=torch.int64, device=combine.device)
        dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=ep_group)
        largest = min(int(capacity.item()), combine.shape[0]) if at_most_tokens else int(capacity.item())
        combine = F.pad(combine, (0, largest - out.capacity))
    return out.l_aux, combine, combine.bool(), out.exp_counts


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: dist.ProcessGroup | None = None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
) -> Gated:
    """DeepSpeed's `top1gating`."""
    _refuse(sparse_routes, use_tutel)
    out = _top1(logits, capacity_factor, min_capacity, noisy_gate_policy, drop_tokens, use_rts, used_token)
    return _tuple(out, drop_tokens, ep_group, at_most_tokens=True)


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: dist.ProcessGroup | None = None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
) -> Gated:
    """DeepSpeed's `top2gating` (it adds the noise into `logits` in place; here they are left as given)."""
    _refuse(sparse_routes)
    out = _top2(logits, capacity_factor, min_capacity, drop_tokens, top2_2nd_expert_sampling)
    return _tuple(out, drop_tokens, ep_group)


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: dist.ProcessGroup | None = None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
) -> Gated:
    """DeepSpeed's `topkgating`."""
    _refuse(sparse_routes)
    out = _topk(logits, k, capacity_factor, min_capacity, drop_tokens, drop_policy)
    return _tuple(out, drop_tokens, ep_group)
