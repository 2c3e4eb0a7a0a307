"""On CUDA: DeepSpeed's parameter attributes ([Note: DeepSpeed's parameter attributes]) and `GatheredParameters`
before `initialize` ([Note: GatheredParameters before initialize]). A `zero_init` model loaded by rank 0 inside
the block (its values broadcast through the GPU when NCCL runs several ranks) trains as the same model built whole;
each `ds_tensor` is on the GPU; a tensor read inside `GatheredParameters` stays valid after it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups

pytestmark = pytest.mark.cuda

WORLD_SIZES = [1, 2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [1]
CASE = Case(stage=3, steps=3)


def _train(engine: Any, rank: int, world_size: int) -> list[float]:
    losses = []
    for batch in global_batches(CASE, world_size)[: CASE.steps]:
        x, y = micro_batch(batch, 0, rank, world_size, CASE.micro)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _run(rank: int, world_size: int) -> dict[str, Any]:
    import zeroshard
    from zeroshard.runtime.zero.partition_parameters import ZeroParamStatus

    out: dict[str, Any] = {}
    whole = build_model(CASE)
    state = {k: v.clone() for k, v in whole.state_dict().items()}
    engine, *_ = zeroshard.initialize(model=whole, model_parameters=param_groups(whole, CASE), config=ds_config(CASE))
    out["expected"] = _train(engine, rank, world_size)
    engine.destroy()

    with zeroshard.zero_init():
        model = build_model(CASE)
    with zeroshard.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            model.load_state_dict(state)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, CASE), config=ds_config(CASE))
    out["loaded"] = _train(engine, rank, world_size)
    released = [p for p in model.parameters() if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
    out["devices"] = {p.ds_tensor.device.type for p in released}
    kept, expected = {}, {}
    for name, p in model.named_parameters():
        with zeroshard.GatheredParameters([p] if p.ds_status is ZeroParamStatus.NOT_AVAILABLE else []):
            kept[name], expected[name] = p.data, p.detach().clone()
    torch.cuda.synchronize()
    out["kept_valid"] = all(torch.equal(t, expected[n]) for n, t in kept.items())
    engine.destroy()
    return out


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_attributes_and_gathered_parameters_before_initialize_on_cuda(world_size: int) -> None:
    for out in run_on_ranks(_run, world_size):
        assert out["loaded"] == out["expected"], out
        assert out["devices"] == {"cuda"}, out["devices"]
        assert out["kept_valid"]
