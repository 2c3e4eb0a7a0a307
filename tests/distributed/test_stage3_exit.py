"""[Note: nothing in flight at exit]: a forward that no backward follows leaves prefetches in flight; the strategy
waits for them when the process ends (or at `destroy`), so no rank exits with a collective pending."""

from __future__ import annotations

import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups


def _eval_then_exit(rank: int, world_size: int):
    import zeroshard
    from zeroshard.zero.stage3.unit import UnitState

    case = Case(stage=3, steps=2)
    model = build_model(case)
    groups = param_groups(model, case)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=groups, config=ds_config(case))
    for batch in global_batches(case, world_size):
        x, y = micro_batch(batch, 0, rank, world_size, case.micro)
        engine.backward(engine(x, y))
        engine.step()
    with torch.no_grad():  # evaluation: the trace's next events are backward's, which never come
        engine(x, y)
    units = engine.strategy.units
    in_flight = [u.name for u in units if u.state is UnitState.GATHERING]
    engine.strategy._settle_at_exit()  # what interpreter exit runs
    return in_flight, [u.name for u in units if u.state is UnitState.GATHERING]


def test_prefetches_left_by_an_evaluation_forward_are_settled_at_exit():
    for in_flight, after in run_on_ranks(_eval_then_exit, 2):
        assert in_flight, "the evaluation forward left no prefetch in flight: this test no longer covers the case"
        assert after == []
