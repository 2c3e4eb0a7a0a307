"""`gradient_allreduce_op: "sum"` ([Note: pre- and post-scaling] in zero/stepmath.py): the step sees the sum over
ranks of each rank's gradient, not their mean. With SGD, no clipping and no weight decay (which would scale
differently) a run with "sum" and learning rate lr is the run with "mean" and lr x world_size; at world size 2 every
scaling is by a power of two, so the two agree bit for bit. Stages 0-2, the fsdp2 backend at stage 2, and
`prescale_gradients` / `gradient_predivide_factor` (which "sum" overrides, as in DeepSpeed)."""

from __future__ import annotations

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, engine_run

LR = 0.05


def _sgd(config: dict, op: str, lr: float, extra: dict) -> dict:
    return {
        **config,
        **extra,
        "gradient_clipping": 0.0,
        "gradient_allreduce_op": op,
        "optimizer": {"type": "SGD", "params": {"lr": lr}},
    }


def _summed(config: dict) -> dict:
    return _sgd(config, "sum", LR, {})


def _summed_with_scaling_keys(config: dict) -> dict:
    return _sgd(config, "sum", LR, {"prescale_gradients": True, "gradient_predivide_factor": 4.0})


def _mean_with_larger_lr(config: dict) -> dict:
    return _sgd(config, "mean", LR * 2, {})


def _fsdp2(configure):
    def wrapped(config: dict) -> dict:
        return {**configure(config), "zeroshard": {"backend": "fsdp2"}}

    return wrapped


def _fsdp2_summed(config: dict) -> dict:
    return _fsdp2(_summed)(config)


def _fsdp2_mean(config: dict) -> dict:
    return _fsdp2(_mean_with_larger_lr)(config)


CASES = [
    (Case(stage=0, weight_decay=0.0, steps=3), _summed, _mean_with_larger_lr),
    (Case(stage=1, weight_decay=0.0, steps=3, gas=2), _summed, _mean_with_larger_lr),
    (Case(stage=2, weight_decay=0.0, steps=3), _summed_with_scaling_keys, _mean_with_larger_lr),
    (Case(stage=2, weight_decay=0.0, steps=3, reduce_scatter=False), _summed, _mean_with_larger_lr),
    (Case(stage=2, weight_decay=0.0, steps=3), _fsdp2_summed, _fsdp2_mean),
]


def _runs(rank: int, world_size: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    out = []
    for case, summed, mean in CASES:
        out.append((engine_run(rank, world_size, case, summed)[1], engine_run(rank, world_size, case, mean)[1]))
    return out


def test_sum_over_ranks_is_the_mean_with_a_world_size_times_larger_step() -> None:
    results = run_on_ranks(_runs, 2, timeout=300)[0]
    for (case, summed, _), (with_sum, with_mean) in zip(CASES, results, strict=True):
        for step, (a, b) in enumerate(zip(with_sum, with_mean, strict=True)):
            assert torch.equal(a, b), (case.name, summed.__name__, step, float((a - b).abs().max()))
        assert not torch.equal(with_sum[0], with_sum[-1]), case.name  # it trained


def test_sum_is_refused_at_stage_3() -> None:
    from zeroshard.config import parse_config
    from zeroshard.errors import ConfigError

    with pytest.raises(ConfigError, match='gradient_allreduce_op "sum"'):
        parse_config({"train_batch_size": 2, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})
