"""Top-1, top-2 and top-k gating with capacity and the load-balancing loss, as DeepSpeed's sharded_moe computes them.

[Note: gating]
A gate scores `S` tokens against `E` experts (softmax in fp32). Each expert takes at most `capacity` tokens:
`ceil(S / E * capacity_factor)` (top-2: `capacity_factor * 2`), at least `min_capacity`, counted on this rank's
tokens. Tokens past an expert's capacity are dropped (their combine weight is zero: the layer outputs zero for
them, the residual path of the caller keeps them). Which tokens stay: top-1 with `use_rts` keeps a random subset
(random token selection), otherwise the first ones in token order (DeepSpeed's `topk` over equal 0/1 scores
leaves that order to the kernel; first-come is its deterministic reading, and what top-2 does). With
`drop_tokens=False` the capacity is the largest expert load on this rank, so nothing is dropped; DeepSpeed also
takes the max over the expert-parallel group so its all-to-all has equal splits, ours is uneven ([Note: expert
exchange] in exchange.py) and needs no agreement. The auxiliary loss is DeepSpeed's: top-1
`E * sum(mean_gates * fraction_routed)`, top-2 `E * E * mean(mean_gates * fraction_routed_first)`, both on the
assignments before capacity. `exp_counts` are the tokens each expert was assigned (top-2: both choices), before
dropping, on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GateOutput:
    """`combine` [S, E, C]: the weight of token s in slot c of expert e; `dispatch` its boolean mask."""

    l_aux: torch.Tensor
    combine: torch.Tensor
    dispatch: torch.Tensor
    exp_counts: torch.Tensor

    @property
    def capacity(self) -> int:
        return int(self.combine.shape[2])


def capacity_for(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """[Note: gating] tokens one expert may take."""
    return max(math.ceil(num_tokens / num_experts * capacity_factor), min_capacity)


def gumbel(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise, drawn as DeepSpeed's `gumbel_rsample` draws it (torch's `Gumbel(0, 1).rsample`: the same
    numbers from the same generator state). Before, a misplaced minus made every value NaN, so RSample and top-2's
    second-expert sampling sent every token to the first expert not already chosen."""
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def _keep_first(mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """Zero the assignments of `mask` [S, E] past the first `capacity` per expert (token order)."""
    return mask * torch.lt(torch.cumsum(mask, dim=0) - 1, capacity)


def _keep_random(mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """Random token selection: per expert, `capacity` assigned tokens chosen at random (the numbers are drawn when
    every token fits too, as DeepSpeed draws them: the generator then moves on alike)."""
    priority = mask * torch.rand(mask.shape, device=mask.device)
    if capacity >= mask.shape[0]:
        return mask
    top = torch.topk(priority, k=capacity, dim=0).indices
    return mask * torch.zeros_like(mask).scatter_(0, top, 1)


def _slots(locations_s: torch.Tensor, capacity: int) -> torch.Tensor:
    """One-hot slot of each token [S, C] (one spare class so that a capacity of zero still works)."""
    return F.one_hot(locations_s, num_classes=capacity + 1)[:, :capacity].float()


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    used_token: torch.Tensor | None = None,
) -> GateOutput:
    """[Note: gating] top-1: each token to its best expert (RSample: best after Gumbel noise); `used_token` [S]
    (DeepSpeed's): tokens whose entry is 0 go to no expert."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    chooser = logits + gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    mask = F.one_hot(torch.argmax(chooser, dim=1), num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.to(mask.dtype).unsqueeze(1)  # (0/1 in any dtype; DeepSpeed's fails on a float one)
    exp_counts = mask.sum(dim=0).detach().cpu()
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = min(int(exp_counts.max()), num_tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    mask = _keep_random(mask, capacity) if use_rts else _keep_first(mask, capacity)
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    combine = torch.einsum("se,sc->sec", gates * mask.float(), _slots(locations, capacity))
    return GateOutput(l_aux, combine, combine.bool(), exp_counts)


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    second_expert_sampling: bool = True,
) -> GateOutput:
    """[Note: gating] top-2: the best expert, and the second best (after Gumbel noise when sampling); the two
    weights renormalised to sum to one over the kept choices. First choices fill an expert before second ones."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=num_experts)
    noisy = logits + gumbel(logits.shape, logits.device) if second_expert_sampling else logits
    mask2 = F.one_hot(torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1), num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach().cpu()
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
    else:
        capacity = int(exp_counts.max())
    gates1 = (gates * mask1.float()).sum(dim=1)
    gates2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates.dtype).eps)
    combine = torch.einsum(
        "se,sc->sec", (gates1 / denom)[:, None] * mask1.float(), _slots((locations1 * mask1).sum(dim=1), capacity)
    ) + torch.einsum(
        "se,sc->sec", (gates2 / denom)[:, None] * mask2.float(), _slots((locations2 * mask2).sum(dim=1), capacity)
    )
    return GateOutput(l_aux, combine, combine.bool(), exp_counts)


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    drop_policy: str = "probs",
) -> GateOutput:
    """[Note: gating] top-k (k > 2, DeepSpeed's `topkgating`): each token to its k most probable experts, the kept
    weights renormalised to sum to one. Capacity `ceil(S / E * capacity_factor * k)`; past it `drop_policy` "probs"
    keeps each expert's most probable tokens, "position" the first ones. Loss `E * E / k * mean(mean_gates *
    fraction_routed)` on the assignments before capacity."""
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"topkgating(drop_policy={drop_policy!r}): choose 'probs' or 'position'")
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach().cpu()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            chosen = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            kept = torch.topk(chosen, k=min(capacity, num_tokens), dim=0, sorted=False).indices
            mask &= torch.zeros_like(mask).scatter_(0, kept, True)
            locations = torch.cumsum(mask, dim=0) - 1
        else:
            locations = torch.cumsum(mask, dim=0) - 1
            mask &= torch.lt(locations, capacity)
    else:
        capacity = int(exp_counts.max())
        locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    slots = F.one_hot(locations * mask, num_classes=capacity).float()
    combine = torch.einsum("se,sec->sec", masked, slots)
    return GateOutput(l_aux, combine, combine.bool(), exp_counts)
