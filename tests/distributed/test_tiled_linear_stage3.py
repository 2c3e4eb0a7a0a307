"""A TiledLinear trained by zeroshard's stage 3 on 2 gloo ranks equals a single-process reference at every step (the
mean loss and every parameter), with the tiles' rows as units (`out_splits >= 2`) and with them in the root unit
(`out_splits == 1`); the units are where [Note: tiles under zeroshard's stage 3] says they are, and without prefetch
or reuse the rows are gathered one at a time."""

from __future__ import annotations

import torch
from torch import nn

from helpers.harness import run_on_ranks
from zeroshard.runtime.zero.tiling import TiledLinear

V, D, H, SEQ, MICRO, STEPS, LR = 3, 9, 10, 5, 2, 4, 1e-2  # a small root unit: the rows are the larger units
IN_SPLITS = 2


class TiledLM(nn.Module):
    """Embedding, a tiled hidden layer (uneven cuts of 9 inputs and 10 outputs), a head."""

    def __init__(self, out_splits: int) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.emb = nn.Embedding(V, D)
        self.hidden = TiledLinear(D, H, in_splits=IN_SPLITS, out_splits=out_splits, init_linear=nn.Linear(D, H))
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.gelu(self.hidden(self.emb(idx)))
        return torch.nn.functional.cross_entropy(self.head(x).view(-1, V), targets.view(-1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the global batch: rank r takes rows [r * MICRO, (r + 1) * MICRO)."""
    g = torch.Generator().manual_seed(4)
    return [
        (torch.randint(0, V, (2 * MICRO, SEQ), generator=g), torch.randint(0, V, (2 * MICRO, SEQ), generator=g))
        for _ in range(STEPS)
    ]


def _reference(out_splits: int) -> tuple[list[float], list[list[torch.Tensor]]]:
    model = TiledLM(out_splits)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, params = [], []
    for x, y in _batches():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        params.append([p.detach().clone() for p in model.parameters()])
    return losses, params


Run = tuple[list[float], list[list[torch.Tensor]], list[tuple[str, int]], int]


def _train(rank: int, world_size: int, out_splits: int) -> Run:
    """Per-step mean loss and full parameters, the units (name, elements) and the largest gathered working set (in
    elements) of the steps after the first (the first forward probes the root unit, [Note: root unit by module])."""
    import torch.distributed as dist

    import zeroshard
    from zeroshard.utils import safe_get_full_fp32_param

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
        },
    }
    engine, _, _, _ = zeroshard.initialize(model=TiledLM(out_splits), config=config)
    units = [(unit.name, unit.numel) for unit in engine.strategy.units]
    losses, params, peak = [], [], 0
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    for step, (x, y) in enumerate(_batches()):
        engine.strategy.schedule.peak_gathered_numel = 0
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
        params.append([safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()])
        peak = max(peak, engine.strategy.schedule.peak_gathered_numel if step else 0)
    engine.destroy()
    return losses, params, units, peak


def _runs(rank: int, world_size: int) -> list[tuple[int, *Run]]:
    return [(out_splits, *_train(rank, world_size, out_splits)) for out_splits in (3, 1)]


def test_a_tiled_linear_trains_like_the_reference_at_stage3() -> None:
    expected_units = {3: ["", "hidden.linears.0", "hidden.linears.1", "hidden.linears.2"], 1: [""]}
    for out_splits, losses, params, units, peak in run_on_ranks(_runs, 2, timeout=300)[0]:
        assert [name for name, _ in units] == expected_units[out_splits], units
        sizes = [numel for _, numel in units]
        if out_splits > 1:  # one unit at a time, the largest being a row
            assert 0 < peak <= max(sizes) < sum(sizes) and max(sizes) == max(sizes[1:]), (peak, units)
        ref_losses, ref_params = _reference(out_splits)
        for step in range(STEPS):
            assert abs(losses[step] - ref_losses[step]) <= 1e-6 * abs(ref_losses[step]), (out_splits, step)
            for p, q in zip(params[step], ref_params[step], strict=True):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"out_splits={out_splits} step={step}")
