"""Training with windows the script ends ([Note: caller-owned windows]): the shared pieces of
tests/distributed/test_managed_accumulation.py and the GPU suite's tests/gpu/test_cuda_windows.py."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from helpers.parity import TINY, Case, build_model, ds_config, flat_params, param_groups

WINDOWS = [1, 3, 2, 1]  # micro-batches per optimizer step, with gradient_accumulation_steps 2
MICRO, GAS = 2, 2


def batches(world_size: int, windows: list[int], steps: int | None = None) -> list[list[tuple[torch.Tensor, ...]]]:
    """Per window, per micro-step, the whole world's micro-batches (rank r takes row block r)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for n in windows[:steps]:
        window = []
        for _ in range(n):
            x = torch.randint(0, TINY.vocab_size, (MICRO * world_size, 16), generator=g)
            window.append((x, torch.roll(x, -1, dims=1)))
        out.append(window)
    return out


def mine(batch: tuple[torch.Tensor, ...], rank: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[rank * MICRO : (rank + 1) * MICRO] for t in batch)


def window_config(case: Case, extra: dict[str, Any], managed: bool) -> dict:
    """DeepSpeed refuses overlap_comm at stages 0-1 with managed_gradient_accumulation false (zeroshard need not)."""
    zero = {
        **ds_config(case)["zero_optimization"],
        "overlap_comm": case.stage >= 2,
        **extra.get("zero_optimization", {}),
    }
    return {**ds_config(case), **extra, "zero_optimization": zero, "managed_gradient_accumulation": managed}


def train_windows(
    rank: int,
    world_size: int,
    engine: Any,
    windows: list[list[tuple[torch.Tensor, ...]]],
    managed: bool,
    gathered: Callable[[list[torch.nn.Parameter]], AbstractContextManager[Any]],
    divisor: int = 1,
):
    """Per window the mean loss, then the parameters and counters; managed engines count the windows themselves.
    `engine` is zeroshard's or DeepSpeed's."""
    losses, boundaries = [], []
    for window in windows:
        step_losses = []
        for batch in window:
            loss = engine(*(t.to(engine.device) for t in mine(batch, rank)))
            engine.backward(loss / divisor if divisor != 1 else loss)
            boundaries.append(engine.is_gradient_accumulation_boundary())
            step_losses.append(loss.item())
            if managed:
                engine.step()
        if not managed:
            engine.step()
        losses.append(sum(step_losses) / len(step_losses))
    with gathered(list(engine.module.parameters())):
        params = flat_params(engine.module)
    counters = (engine.global_steps, engine.global_samples, engine.micro_steps)
    return losses, params, boundaries, counters


def ours(rank: int, world_size: int, case: Case, extra: dict, managed: bool, windows: list[int], divisor: int = 1):
    import zeroshard
    from zeroshard.zero import GatheredParameters

    model = build_model(case)
    config = window_config(case, extra, managed)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    out = train_windows(rank, world_size, engine, batches(world_size, windows), managed, GatheredParameters, divisor)
    engine.destroy()
    return out


def same_as_managed(rank: int, world_size: int, cases: list[tuple[Case, dict]]) -> list[Any]:
    """Each case managed and with the script ending windows of gradient_accumulation_steps micro-batches."""
    windows = [GAS] * 4
    return [[ours(rank, world_size, c, e, managed, windows[: c.steps]) for managed in (True, False)] for c, e in cases]


def check_same_as_managed(cases: list[tuple[Case, dict]], per_rank: list[Any]) -> None:
    """Losses and parameters to the bit, boundaries only inside step(), counters as the managed engine's."""
    for per_case in per_rank:
        for (case, extra), (managed, unmanaged) in zip(cases, per_case, strict=True):
            name = case.name + str(extra)
            assert unmanaged[0] == managed[0], name  # losses, to the bit
            assert unmanaged[1].equal(managed[1]), name  # parameters
            assert managed[2] == [False, True] * case.steps, name
            assert unmanaged[2] == [False] * (2 * case.steps), name  # no backward is a boundary
            steps, samples, _ = unmanaged[3]
            assert (steps, samples) == managed[3][:2] == (case.steps, case.steps * GAS * MICRO * len(per_rank)), name
            assert unmanaged[3][2] == case.steps, name  # a micro-step per step() call, as DeepSpeed counts


def reference_windows(
    world_size: int, case: Case, windows: list[int], divisor: Callable[[int], int]
) -> tuple[list[float], torch.Tensor]:
    """Plain PyTorch over `batches(world_size, windows)`: per window every rank's micro-batches, each loss divided by
    `divisor(window length)` x world (the engine's division and its mean over ranks), then clipping and AdamW.
    Returns each window's mean loss and the final parameters."""
    model = build_model(case)
    optimizer = torch.optim.AdamW(param_groups(model, case), lr=case.lr)
    losses = []
    for window in batches(world_size, windows):
        model.zero_grad()
        step_losses = []
        for batch in window:
            for r in range(world_size):
                loss = model(*mine(batch, r))
                (loss / (divisor(len(window)) * world_size)).backward()
                step_losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        optimizer.step()
        losses.append(sum(step_losses) / len(step_losses))
    return losses, flat_params(model)
