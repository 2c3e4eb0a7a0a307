"""AutoTP on 2 gloo ranks (tp2): the ranks of a tensor-parallel group given different inputs at the first forward stop
on every rank with one line naming the input, before the forward runs ([Note: a tensor-parallel group reads one
batch]; DeepSpeed asserts "Data inconsistency within the TP group"); given the same inputs they train, and the check
leaves the module after that forward. DeepSpeed's engine attributes for its groups (`data_parallel_group`,
`seq_data_parallel_group`, `mp_world_size`, `checkpoint_mp_rank`) and `initialize(mesh_param=)`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.tp_parity import TpCase, batch, config, llama


def _tp_ranks(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    import zeroshard

    out: dict[str, Any] = {}
    engine, *_ = zeroshard.initialize(model=llama(), config=config(TpCase(stage=1)))
    out["groups"] = (
        dist.get_world_size(engine.data_parallel_group),
        dist.get_world_size(engine.seq_data_parallel_group),
        engine.mp_world_size,
        engine.checkpoint_mp_rank,
    )
    ids = batch(0, rank)  # each rank its own sample: a loader sharded over the world
    try:
        engine(input_ids=ids, labels=ids)
    except Exception as error:  # noqa: BLE001 - the test reads the message
        out["error"] = f"{type(error).__name__}: {error}"
    out["hooks_after_error"] = len(engine.module._forward_pre_hooks)
    engine.destroy()
    engine, *_ = zeroshard.initialize(model=llama(), config=config(TpCase(stage=1)))
    hooks_before = len(engine.module._forward_pre_hooks)
    losses = []
    for step in range(2):
        ids = batch(step, 0)  # the same sample on both ranks
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 0:
            out["hooks_after_first"] = hooks_before - len(engine.module._forward_pre_hooks)
    out["losses"] = losses
    engine.destroy()
    return out


def test_a_tensor_parallel_group_given_different_batches_stops_at_once() -> None:
    results = run_on_ranks(_tp_ranks, 2)
    for rank, out in enumerate(results):
        assert out["groups"] == (1, 1, 2, rank)
        assert out["error"].startswith(
            "ZeroshardError: tensor parallelism: the ranks of tensor-parallel group [0, 1] were given different inputs "
            "at the first forward (kwargs['input_ids'] differs on ranks [1] from rank 0's)"
        ), out["error"]
        assert out["hooks_after_first"] == 1  # the check left with the first forward
        assert all(torch.isfinite(torch.tensor(out["losses"])))
    assert results[0]["losses"] == results[1]["losses"]


def _mesh_param(rank: int, world_size: int, mesh: Any, extra: dict[str, Any]) -> Any:
    import zeroshard
    from zeroshard.errors import ConfigError

    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        **extra,
    }
    try:
        engine, *_ = zeroshard.initialize(model=torch.nn.Linear(4, 4), config=cfg, mesh_param=mesh)
    except ConfigError as error:
        return str(error)
    return engine.sequence_parallel_size, engine.dp_world_size


@pytest.mark.parametrize(
    ("mesh", "extra", "expected"),
    [
        ((1, 2), {}, (2, 1)),
        ((2, 1), {"sequence_parallel_size": 1}, (1, 2)),
        ((1, 2), {"sequence_parallel_size": 1}, "sets sequence_parallel_size=2 but the config says 1"),
        ((2,), {}, "give (data-parallel size, sequence-parallel size)"),
    ],
)
def test_mesh_param_is_the_configs_mesh(mesh: Any, extra: dict[str, Any], expected: Any) -> None:
    for out in run_on_ranks(_mesh_param, 2, mesh, extra):
        assert out == expected if isinstance(expected, tuple) else expected in out, out
