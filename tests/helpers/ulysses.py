"""A GPT whose attention is DeepSpeed-Ulysses' `DistributedAttention`, for the sequence-parallel parity tests.

It has the parity GPT's parameters (same names, same seed), reads one rank's part of each sequence, and returns
that part's summed cross-entropy divided by the token count of the whole sequences, so the P ranks' losses add up
to the reference's mean loss ([Note: sequence parallelism]).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from helpers.parity import Case, build_model
from zeroshard.models.gpt import GPT, CausalSelfAttention, GPTConfig
from zeroshard.sequence.layer import DistributedAttention


def local_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[batch, seq, heads, head_dim] in and out: the whole sequence, this rank's heads."""
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return y.transpose(1, 2)


class UlyssesSelfAttention(CausalSelfAttention):
    def __init__(self, cfg: GPTConfig, group: Any = None, attention: type = DistributedAttention):
        super().__init__(cfg)
        self.attention = attention(local_causal_attention, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.reshape(b, t, self.n_head, c // self.n_head) for z in self.qkv(x).split(c, dim=2))
        return self.proj(self.attention(q, k, v, batch_dim_idx=0).reshape(b, t, c))


class UlyssesGPT(nn.Module):
    def __init__(self, gpt: GPT):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, offset: int, tokens: int) -> torch.Tensor:
        gpt = self.gpt
        x = gpt.wte(idx) + gpt.wpe(torch.arange(offset, offset + idx.shape[1], device=idx.device))
        for block in gpt.blocks:
            x = block(x)
        logits = gpt.lm_head(gpt.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction="sum") / tokens


def ulysses_model(case: Case, group: Any = None, attention: type = DistributedAttention) -> UlyssesGPT:
    """The parity GPT of `case` with every attention made sequence-parallel (the same initial values); `attention`
    is zeroshard's `DistributedAttention` or DeepSpeed's."""
    gpt = build_model(case)
    assert isinstance(gpt, GPT)
    for block in gpt.blocks:
        state = block.attn.state_dict()
        block.attn = UlyssesSelfAttention(gpt.config, group, attention)
        block.attn.load_state_dict(state)
    return UlyssesGPT(gpt)
