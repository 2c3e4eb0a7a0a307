"""A GPT whose MLPs and loss are tiled along the sequence ([Note: tiled compute]), for the tiled-compute parity
tests: the parity GPT's parameters and initial values (the embedding tied to lm_head), each block's MLP through
`TiledMLP` (4 slices by default), and the loss through `TiledFusedLogitsLoss` (3 slices of the tokens, summed, over
the token count: the token mean), or through `sequence_tiled_compute` with a loss per slice."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from helpers.parity import Case, build_model
from zeroshard.models.gpt import GPT
from zeroshard.runtime.sequence_parallel import ulysses_sp


class TiledSequential(nn.Module):
    def __init__(self, mlp: nn.Sequential, weights: str, api: Any, shards: int):
        super().__init__()
        self.mlp = mlp
        self.shards = shards
        self.api = api  # the module with the tiled helpers: zeroshard's ulysses_sp, or DeepSpeed's
        # "listed": compute_params given, as DeepSpeed's examples; "default": None (the module's); "none": [] (no
        # weight is held back: every slice's gradient reaches the engine); "off": not tiled
        self.weights = weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weights == "off":
            return self.mlp(x)
        params = {"listed": list(self.mlp.parameters()), "default": None, "none": []}[self.weights]
        return self.api.TiledMLP.apply(lambda module, piece: module(piece), self.mlp, x, self.shards, params)


def _summed_loss(gpt: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = gpt.lm_head(gpt.ln_f(x)).float()
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), reduction="sum")


def _guarded_loss(gpt: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A fully masked slice skips lm_head (SFT code's guard): its weights get nothing from that slice."""
    return (x * 0).sum() if bool((y == -100).all()) else _summed_loss(gpt, x, y)


class TiledGPT(nn.Module):
    def __init__(self, gpt: GPT, loss: str, api: Any, shards: int):
        super().__init__()
        self.gpt = gpt
        self.shards = shards
        self.api = api
        # "fused": TiledFusedLogitsLoss ("guarded": skipping lm_head on a fully masked slice); "generic":
        # sequence_tiled_compute; "plain": not tiled
        self.loss = loss

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        gpt = self.gpt
        x = gpt.wte(idx) + gpt.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in gpt.blocks:
            x = block(x)
        head = [gpt.lm_head.weight, *gpt.ln_f.parameters()]
        if self.loss == "plain":
            total = _summed_loss(gpt, x, targets)
        elif self.loss in ("fused", "guarded"):
            fn = _guarded_loss if self.loss == "guarded" else _summed_loss
            total = self.api.TiledFusedLogitsLoss.apply(fn, gpt, x, targets, None, self.shards, head, "sum")
        else:
            total = self.api.sequence_tiled_compute(
                lambda self, x, y: _summed_loss(self, x, y),
                idx.shape[1],
                self.shards,
                {"x": x, "y": targets},
                {"self": gpt},
                "x",
                head,
                output_unshard_dimension=0,
                output_reduction="sum",
            )
        return total / targets.numel()


def tiled_model(case: Case, weights: str = "listed", loss: str = "fused") -> TiledGPT:
    gpt = build_model(case)
    assert isinstance(gpt, GPT)
    return tile(gpt, weights, loss)


def tile(
    gpt: GPT, weights: str, loss: str, api: Any = ulysses_sp, mlp_shards: int = 4, loss_shards: int = 3
) -> TiledGPT:
    """`gpt` with its MLPs and loss tiled by `api`'s helpers (same parameters, same values)."""
    for block in gpt.blocks:
        block.mlp = TiledSequential(block.mlp, weights, api, mlp_shards)  # type: ignore[assignment]
    return TiledGPT(gpt, loss, api, loss_shards)
