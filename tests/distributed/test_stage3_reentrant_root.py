"""ZeRO-3 with torch's reentrant checkpoint over a method of the root module ([Note: recompute]): the root unit's
parameters are used inside the checkpoint (its first pass under no_grad, recomputed in backward) and outside it.
Its gradients used to be reduced after the backward of the use outside, before the recompute's arrived (a
ZeroshardError naming `linear1.bias`; DeepSpeed 0.19.8 trains it, its `TestZeroUserBackwardFrozenParamCheckpointing`).
On 2 gloo ranks every step's loss and gradients equal a single-process reference, with a frozen norm too, and with a
plain no_grad region beside the checkpoint (its unit reduced when backward ends)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers.harness import run_on_ranks

STEPS, H = 3, 8
VARIANTS = ("reentrant", "frozen_norm", "no_grad_beside")


class _Model(nn.Module):
    def __init__(self, variant: str):
        super().__init__()
        torch.manual_seed(42)
        self.norm, self.linear1, self.linear2 = nn.LayerNorm(H), nn.Linear(H, H), nn.Linear(H, H)
        self.variant = variant
        if variant == "frozen_norm":
            self.norm.requires_grad_(False)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear1(self.norm(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear2(checkpoint(self.block, x, use_reentrant=True))
        if self.variant == "no_grad_beside":
            with torch.no_grad():
                extra = self.linear2(x).mean()  # a use of the root's parameters whose backward never runs
            out = out + extra
        return out


def _batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, H, generator=gen).requires_grad_(True)


def _engine_run(rank: int, world_size: int) -> dict[str, Any]:
    import zeroshard
    from zeroshard.utils import safe_get_full_grad

    out: dict[str, Any] = {}
    for variant in VARIANTS:
        model = _Model(variant)
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        trained = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = zeroshard.initialize(model=model, model_parameters=trained, config=cfg)
        losses, grads = [], []
        for step in range(STEPS):
            loss = engine(_batch(step, rank)).pow(2).mean()
            engine.backward(loss)
            grads.append({n: safe_get_full_grad(p).clone() for n, p in model.named_parameters() if p.requires_grad})
            engine.step()
            losses.append(float(loss))
        engine.destroy()
        out[variant] = (losses, grads)
    return out


def _reference(variant: str, world_size: int) -> tuple[list[list[float]], list[dict[str, torch.Tensor]]]:
    model = _Model(variant)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        per = [model(_batch(step, r)).pow(2).mean() for r in range(world_size)]
        opt.zero_grad()
        torch.stack(per).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        opt.step()
        losses.append([float(v.detach()) for v in per])
    return losses, grads


def test_a_reentrant_checkpoint_inside_the_root_unit_trains_as_the_reference() -> None:
    results = run_on_ranks(_engine_run, 2)
    for variant in VARIANTS:
        ref_losses, ref_grads = _reference(variant, 2)
        for rank, result in enumerate(results):
            losses, grads = result[variant]
            for step in range(STEPS):
                assert math.isclose(losses[step], ref_losses[step][rank], rel_tol=1e-6), (variant, rank, step)
                for name, g in grads[step].items():
                    assert torch.allclose(g, ref_grads[step][name], rtol=1e-6, atol=1e-7), (variant, rank, step, name)
