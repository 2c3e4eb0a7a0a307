"""`adapt_batch` ([Note: pipeline checkpoints], docs/checkpoint.md): a load into another data-parallel degree keeps
the saved global batch by changing gradient accumulation, counting the replicas the config's batch counts, not the
ranks of the checkpoint's world (a tp x dp lane group holds tp ranks a replica)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from zeroshard.checkpoint.batch import adapt_batch
from zeroshard.config import parse_config, resolve_config
from zeroshard.zero.strategy import AccumulationState


def _engine(replicas: int, ranks: int, **batch: Any) -> Any:
    given = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, **batch}
    raw = {k: v for k, v in given.items() if v}
    cfg = resolve_config(parse_config(raw), world_size=replicas)
    return SimpleNamespace(
        config=cfg,
        accumulation=AccumulationState(int(cfg.gradient_accumulation_steps), communicate_every_micro_step=False),
        topology=SimpleNamespace(world_size=ranks),
        strategy=None,
    )


def _saved(train: int, gas: int) -> Any:
    return SimpleNamespace(
        batch={"train_batch_size": train, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas}
    )


def test_fewer_replicas_of_a_tensor_parallel_lane_group_double_the_accumulation() -> None:
    engine = _engine(replicas=1, ranks=2)  # pp x tp2 x dp1: a stage's lane group is 2 ranks, 1 replica
    assert adapt_batch(engine, _saved(16, 4))  # saved by tp2 x dp2: 2 x 4 x 2
    assert (engine.config.gradient_accumulation_steps, engine.config.train_batch_size) == (8, 16)
    assert engine.accumulation.gradient_accumulation_steps == 8


def test_more_replicas_halve_it_and_a_pinned_or_indivisible_batch_stays() -> None:
    engine = _engine(replicas=2, ranks=2, gradient_accumulation_steps=8)
    assert adapt_batch(engine, _saved(16, 8)) and engine.config.gradient_accumulation_steps == 4
    pinned = _engine(replicas=1, ranks=1, train_batch_size=8, gradient_accumulation_steps=0)  # 0: left out
    assert not adapt_batch(pinned, _saved(16, 4)) and pinned.config.gradient_accumulation_steps == 4
    odd = _engine(replicas=3, ranks=3)
    assert not adapt_batch(odd, _saved(16, 4)) and odd.config.gradient_accumulation_steps == 4


def test_a_strategy_that_cannot_change_its_window_keeps_the_accumulation() -> None:
    """Stage 3 built for one micro-step keeps its gradient shards in the reduction's dtype (bf16): a resume that
    would accumulate keeps gradient_accumulation_steps as configured, as `set_train_batch_size` refuses it."""
    engine = _engine(replicas=1, ranks=1, gradient_accumulation_steps=1)
    engine.strategy = SimpleNamespace(window_change_refused=lambda gas: f"no window of {gas}")
    assert not adapt_batch(engine, _saved(8, 2))
    assert engine.config.gradient_accumulation_steps == engine.accumulation.gradient_accumulation_steps == 1
