"""A backward the script runs itself ([Note: a backward the engine did not start] in manual_backward.py):
`loss.backward()` on the engine's output trains bit for bit as `engine.backward(loss)` at every stage and tier, and
as DeepSpeed 0.19.8's torch-style backward; under fp16 it needs `engine.scale(loss)`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, flat_params, param_groups, relative_difference
from helpers.windows import batches, mine

WINDOWS = [2, 2, 2]  # gradient_accumulation_steps 2
CASES: list[tuple[Case, dict[str, Any]]] = [
    (Case(stage=0, gas=2), {}),
    (Case(stage=1, gas=2), {}),
    (Case(stage=2, gas=2, offload="cpu"), {}),
    (Case(stage=3, gas=2), {}),
    (Case(stage=3, gas=2, offload="cpu", offload_param="cpu"), {}),
    (Case(stage=3, gas=2), {"zeroshard": {"backend": "fsdp2"}}),
]


def _train(rank: int, world_size: int, engine: Any, how: str, gathered: Any) -> tuple[list[float], torch.Tensor]:
    losses = []
    for window in batches(world_size, WINDOWS):
        for batch in window:
            loss = engine(*mine(batch, rank))
            if how == "engine":
                engine.backward(loss)
            elif how == "scale":
                engine.scale(loss).backward()
            else:
                loss.backward()
            losses.append(loss.item())
            engine.step()
    with gathered(list(engine.module.parameters())):
        return losses, flat_params(engine.module)


def _ours(rank: int, world_size: int) -> list[Any]:
    import zeroshard

    out = []
    for case, extra in CASES:
        for how in ("engine", "plain"):
            model = build_model(case)
            config = {**ds_config(case), **extra}
            engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
            out.append(_train(rank, world_size, engine, how, zeroshard.GatheredParameters))
            assert engine.micro_steps == sum(WINDOWS) and engine.global_steps == len(WINDOWS)
            engine.destroy()
    return out


def test_a_plain_backward_trains_as_engine_backward() -> None:
    for per_rank in run_on_ranks(_ours, 2):
        for i, (case, extra) in enumerate(CASES):
            (engine_losses, engine_params), (plain_losses, plain_params) = per_rank[2 * i], per_rank[2 * i + 1]
            assert plain_losses == engine_losses, (case.name, extra)
            assert torch.equal(plain_params, engine_params), (case.name, extra)


def _against_deepspeed(rank: int, world_size: int) -> list[Any]:
    import zeroshard

    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    out = []
    for stage in (1, 2, 3):
        for lib, gathered in (
            (zeroshard, zeroshard.GatheredParameters),
            (deepspeed, deepspeed.zero.GatheredParameters),
        ):
            case = Case(stage=stage, gas=2)
            model = build_model(case)
            engine, *_ = lib.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
            out.append(_train(rank, world_size, engine, "plain", gathered))
            engine.destroy()
    return out


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by a plain backward:
# test_a_plain_backward_trains_as_engine_backward
@pytest.mark.slow
def test_a_plain_backward_trains_as_deepspeeds() -> None:
    """DeepSpeed 0.19.8 divides the gradient entering the engine's outputs by gradient_accumulation_steps too."""
    for per_rank in run_on_ranks(_against_deepspeed, 2, timeout=900):
        for stage in (1, 2, 3):
            (ours, our_params), (theirs, their_params) = per_rank[2 * (stage - 1)], per_rank[2 * (stage - 1) + 1]
            assert torch.allclose(torch.tensor(ours), torch.tensor(theirs), rtol=1e-6), stage
            assert relative_difference(our_params, their_params) < 1e-6, stage


def _fp16(rank: int, world_size: int) -> list[Any]:
    import zeroshard

    case = Case(stage=2, gas=2, dtype="fp16")
    out = []
    for how in ("engine", "scale"):
        model = build_model(case)
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        out.append(_train(rank, world_size, engine, how, zeroshard.GatheredParameters))
        engine.destroy()
    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    x, y = mine(batches(world_size, [1])[0][0], rank)
    with pytest.raises(zeroshard.ZeroshardError, match=r"without loss scaling under fp16: call engine.backward"):
        engine(x, y).backward()
    engine.destroy()
    return out


def test_fp16_needs_engine_scale() -> None:
    for (engine_losses, engine_params), (scaled_losses, scaled_params) in run_on_ranks(_fp16, 2):
        assert scaled_losses == engine_losses
        assert torch.equal(scaled_params, engine_params)


def _penalty(rank: int, world_size: int) -> list[Any]:
    """A gradient penalty's `torch.autograd.grad` through the engine's output accumulates into no parameter: no
    micro-step, its gradient undivided; the training is the run without it, however the backward is made."""
    import zeroshard

    out = []
    for how, penalty in (("engine", False), ("plain", True), ("engine", True)):
        case = Case(stage=2, gas=2)
        model, config = build_model(case), ds_config(case)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        grads = []
        for window in batches(world_size, WINDOWS):
            for batch in window:
                loss = engine(*mine(batch, rank))
                if penalty:
                    (g,) = torch.autograd.grad(loss, [engine.module.wte.weight], retain_graph=True)
                    grads.append(g.clone())
                loss.backward() if how == "plain" else engine.backward(loss)
                engine.step()
        with zeroshard.GatheredParameters(list(engine.module.parameters())):
            out.append((grads, flat_params(engine.module), engine.micro_steps))
        engine.destroy()
    reference = build_model(Case(stage=2, gas=2))  # the first micro-batch's gradient, in plain PyTorch
    (g,) = torch.autograd.grad(reference(*mine(batches(world_size, WINDOWS)[0][0], rank)), [reference.wte.weight])
    out.append(g)
    return out


def test_autograd_grad_through_the_engine_is_no_micro_step() -> None:
    for (_, plain_params, plain_steps), (grads, params, steps), (engine_grads, _, _), first in run_on_ranks(
        _penalty, 2
    ):
        assert steps == plain_steps == sum(WINDOWS) and torch.equal(params, plain_params)
        assert all(torch.equal(a, b) for a, b in zip(grads, engine_grads, strict=True))
        torch.testing.assert_close(grads[0], first, rtol=1e-6, atol=1e-7)  # not divided by the accumulation


class _TwoHeads(torch.nn.Module):
    """Two outputs whose graphs reach different leaves first: the loss on the second must still be a micro-step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Linear(8, 8)
        self.first = torch.nn.Linear(8, 2)
        self.second = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.first(h).sum(), self.second(h).pow(2).mean()


def _edges(rank: int, world_size: int) -> dict[str, Any]:
    """engine.backward with a factor of 1 (no second micro-step inside it), the second of two outputs, a reentrant
    checkpoint around the whole engine, and caller-owned windows."""
    import zeroshard

    out: dict[str, Any] = {}
    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(4)]
    for stage in (1, 3):
        for how in ("engine", "plain", "checkpointed"):
            config = {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "zero_optimization": {"stage": stage},
                "managed_gradient_accumulation": False,
            }
            engine, *_ = zeroshard.initialize(model=_TwoHeads(), config=config)
            starts = []
            begins = engine._manual_backward_begins
            engine._manual._begin = lambda begins=begins, starts=starts: (starts.append(1), begins())[1]
            for x in data:
                if how == "checkpointed":
                    # reentrant checkpointing needs an input that requires grad
                    _, loss = torch.utils.checkpoint.checkpoint(engine, x.requires_grad_(True), use_reentrant=True)
                else:
                    _, loss = engine(x)
                loss.backward() if how == "plain" else engine.backward(loss)
                engine.step()
            with zeroshard.GatheredParameters(list(engine.module.parameters())):
                params = flat_params(engine.module)
            out[(stage, how)] = (params, engine.global_samples, len(starts))
            engine.destroy()
    return out


def test_factor_one_second_output_reentrant_checkpoint_and_caller_windows() -> None:
    for out in run_on_ranks(_edges, 2):
        for stage in (1, 3):
            params, samples, starts = out[(stage, "engine")]
            assert starts == 0 and samples == 4 * 4 * 2, (stage, samples, starts)  # one micro-step per backward
            plain_params, plain_samples, plain_starts = out[(stage, "plain")]
            assert plain_starts == 4 and plain_samples == samples and torch.equal(plain_params, params), stage
            checkpointed, checkpointed_samples, checkpointed_starts = out[(stage, "checkpointed")]
            assert checkpointed_starts == 0 and checkpointed_samples == samples, stage
            assert torch.equal(checkpointed, params), stage
