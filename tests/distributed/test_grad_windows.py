"""Stages 0-2 start each accumulation window from zero gradients although stages 0/1 no longer zero-fill their
accumulator ([Note: the full accumulator is not zero-filled per window] in zero/flat/reducer.py): a parameter that
got a gradient in the last window and none in this one reads as zero (`safe_get_full_grad`, the step), and a step
with no backward at all steps on zero gradients. Stage 2 still zeroes eagerly, so the three stages must agree."""

from __future__ import annotations

import torch
from torch import nn

from helpers.harness import run_on_ranks
from helpers.parity import TINY, relative_difference
from zeroshard.models.gpt import GPT


class SideGPT(nn.Module):
    """A GPT plus a side layer that takes part in the loss only while `use_side` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(TINY)
        self.side = nn.Linear(TINY.n_embd, 1)
        self.use_side = True

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.gpt(idx, targets)
        if self.use_side:
            loss = loss + 0.01 * self.side(self.gpt.wte(idx)).mean()
        return loss


def _windows(rank: int, world_size: int, stage: int):
    import zeroshard
    from zeroshard.utils.tensor_fragment import safe_get_full_grad

    torch.manual_seed(7)
    model = SideGPT()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 4096},
    }
    engine, *_ = zeroshard.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(0, TINY.vocab_size, (2, 16), generator=gen)
    engine.backward(engine(x, x))  # window 1: the side layer gets a gradient
    engine.step()
    model.use_side = False
    engine.backward(engine(x, x))  # window 2: it gets none
    side_grad = safe_get_full_grad(model.side.weight)
    engine.step()
    before = model.side.weight.detach().clone()
    engine.step()  # window 3: no backward at all
    moved = float((model.side.weight.detach() - before).abs().max())  # Adam's momentum alone moves it
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return float(side_grad.abs().max()), moved, params


def test_windows_start_from_zero_gradients_at_stages_0_1_2() -> None:
    results = {stage: run_on_ranks(_windows, 2, stage) for stage in (0, 1, 2)}
    for stage, ranks in results.items():
        for side_grad, moved, _ in ranks:
            assert side_grad == 0.0, (stage, side_grad)  # not the first window's gradient
            assert moved > 0.0, stage
    reference = results[2][0][2]
    for stage in (0, 1):
        for _, _, params in results[stage]:
            assert relative_difference(params, reference) <= 1e-6, stage


def _mid_window(rank: int, world_size: int, peek: bool):
    import zeroshard
    from zeroshard.utils.tensor_fragment import safe_get_full_grad

    torch.manual_seed(7)
    model = GPT(TINY)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000},
    }
    engine, *_ = zeroshard.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(100 + rank)
    peeked, final = [], []
    for _ in range(4):  # two windows of two micro-steps
        x = torch.randint(0, TINY.vocab_size, (2, 16), generator=gen)
        engine.backward(engine(x, x))
        if not engine.is_gradient_accumulation_boundary():
            if peek:
                peeked += [float(safe_get_full_grad(p).abs().max()) for p in model.parameters()]
        else:
            final.append(torch.cat([safe_get_full_grad(p).reshape(-1) for p in model.parameters()]))
        engine.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return peeked, final, params


def test_stage1_gradient_read_inside_a_window_leaves_its_accumulation_alone() -> None:
    """Stage 1's gradient shard is the front of its full accumulator ([Note: stage 1's shard inside its
    accumulator] in zero/flat/reducer.py): `safe_get_full_grad` before the window's reduction reads this rank's own
    accumulation so far, as DeepSpeed's does (it answered zeros), and must not change it."""
    peeking = run_on_ranks(_mid_window, 2, True)
    plain = run_on_ranks(_mid_window, 2, False)
    for (peeked, grads, params), (_, plain_grads, plain_params) in zip(peeking, plain, strict=True):
        assert peeked and max(peeked) > 0.0
        assert len(grads) == 2 and all(float(g.abs().max()) > 0 for g in grads)
        for g, p in zip(grads, plain_grads, strict=True):
            assert torch.equal(g, p)
        assert torch.equal(params, plain_params)
