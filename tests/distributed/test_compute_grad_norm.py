"""`zero_optimization.compute_grad_norm: false` (stages 1-2, DeepSpeed's knob): the step skips the gradient norms and
their all-reduce; without clipping the updates are the same to the bit, `get_global_grad_norm()` is None, and fp16's
overflow check still skips a step whose gradients overflow."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, flat_params, global_batches, micro_batch, param_groups

CASES = [
    (Case(stage=1, clip=0.0), {}),
    (Case(stage=2, clip=0.0, gas=2), {}),
    (Case(stage=2, clip=0.0, dtype="bf16", steps=3), {}),
    (Case(stage=2, clip=0.0), {"zeroshard": {"backend": "fsdp2"}}),
]


def _train(rank: int, world_size: int, case: Case, extra: dict[str, Any], norm: bool, fp16: bool = False) -> Any:
    import zeroshard

    model = build_model(case)
    config = {**ds_config(case), **extra}
    config["zero_optimization"] = {**config["zero_optimization"], "compute_grad_norm": norm}
    if fp16:  # a scale that overflows the first steps' gradients: they are skipped, until it has come down
        config = dict(config, bf16={"enabled": False}, fp16={"enabled": True, "initial_scale_power": 20})
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    losses, norms, all_reduces = [], [], []
    for batch in global_batches(case, world_size):
        before = engine.comm_stats.snapshot()["all_reduce"]["calls"]
        for k in range(case.gas):
            loss = engine(*(t.to(engine.device) for t in micro_batch(batch, k, rank, world_size, case.micro)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
        all_reduces.append(engine.comm_stats.snapshot()["all_reduce"]["calls"] - before)
    with engine.gathered_for_generation():
        params = flat_params(engine.module)
    skipped = engine.skipped_steps
    engine.destroy()
    return losses, norms, all_reduces, params, skipped


def _runs(rank: int, world_size: int) -> list[Any]:
    out = [(_train(rank, world_size, c, e, True), _train(rank, world_size, c, e, False)) for c, e in CASES]
    fp16 = Case(stage=2, clip=0.0, dtype="bf16", steps=6)
    out.append((_train(rank, world_size, fp16, {}, True, True), _train(rank, world_size, fp16, {}, False, True)))
    return out


def test_no_grad_norm_steps_the_same_without_the_norm_or_its_all_reduce() -> None:
    for per_case in run_on_ranks(_runs, 2, timeout=600):
        for (case, _), (with_norm, without) in zip([*CASES, (None, None)], per_case, strict=True):
            losses, norms, all_reduces, params, skipped = with_norm
            losses_off, norms_off, all_reduces_off, params_off, skipped_off = without
            assert losses_off == losses and params_off.equal(params), case
            assert skipped_off == skipped, case
            assert all(n is None for n in norms_off), (case, norms_off)
            if case is None:  # fp16: the overflowing first steps are skipped with or without the norm, then it trains
                assert 1 <= skipped < 6, skipped
                # a skipped step's norm reads inf where one is computed (DeepSpeed's ZeRO), None where not (above)
                assert sum(math.isinf(float(n)) for n in norms) == skipped, norms
            else:
                assert all(isinstance(n, torch.Tensor) and n.dim() == 0 for n in norms), (case, norms)
                # one all-reduce fewer per step: the squared norm's
                assert all(a - b == 1 for a, b in zip(all_reduces, all_reduces_off, strict=True)), (
                    case,
                    all_reduces,
                    all_reduces_off,
                )


@pytest.mark.parametrize(
    "zero, extra, message",
    [
        ({"stage": 3}, {}, "only stage 1 or 2"),
        ({"stage": 2}, {"gradient_clipping": 1.0}, "needs gradient_clipping 0"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, {"gradient_clipping": 0.0}, "with optimizer offload"),
    ],
)
def test_no_grad_norm_is_refused_where_deepspeed_refuses_it(zero: dict, extra: dict, message: str) -> None:
    from zeroshard.config import parse_config
    from zeroshard.errors import ConfigError

    raw = {"train_batch_size": 2, "zero_optimization": {**zero, "compute_grad_norm": False}, **extra}
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)
