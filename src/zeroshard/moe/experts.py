"""This rank's experts: `num_local_experts` deep copies of the user's expert module."""

from __future__ import annotations

import copy

import torch
from torch import nn


class Experts(nn.Module):
    """The local experts (DeepSpeed's `Experts`: deep copies, so they start equal; `deepspeed_experts` keeps
    DeepSpeed's state_dict keys)."""

    def __init__(self, expert: nn.Module, num_local_experts: int):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts

    def forward(self, tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        """Expert l's output for its `[n_l, M]` tokens (a tuple output keeps its first element, as DeepSpeed)."""
        outputs = []
        for chunk, expert in zip(tokens, self.deepspeed_experts, strict=True):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return outputs
