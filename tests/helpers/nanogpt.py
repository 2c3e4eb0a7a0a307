"""A nanoGPT-style model whose constructor writes its own initialisation (ones in a custom LayerNorm, GPT-2's scaled
residual projections, a causal-mask buffer, a tied head), its ZeRO-3 config and batches: what the `zero_init` tests
build ([Note: initialisation recorded under zero_init])."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from zeroshard.models.gpt import GPT

LAYERS, WIDTH, VOCAB, T = 2, 32, 64, 8


class LayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = LayerNorm(WIDTH)
        self.attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, T, T))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn(self.ln(x)).split(WIDTH, dim=2)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(WIDTH)
        scores = scores.masked_fill(self.mask[:, : x.shape[1], : x.shape[1]] == 0, float("-inf"))
        return x + self.c_proj(scores.softmax(-1) @ v)


class NanoGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.ln_f = LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * LAYERS))

    _init_weights = staticmethod(GPT._init_weights)  # nanoGPT's: normal(0.02) linears and embeddings, zero biases

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).flatten(0, 1), targets.flatten())


def nanogpt_config(backend: str) -> dict[str, Any]:
    return {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zeroshard": {"backend": backend},
    }


def nanogpt_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, VOCAB, (4, T), generator=g) for _ in range(6)]
    return [(tokens[2 * k], tokens[2 * k + 1]) for k in range(3)]
