"""`zero_optimization.log_trace_cache_warnings`: a stage-3 step whose units run in another order than the recorded
trace logs one warning naming the unit and the one expected (prefetching stops for that step); off by default."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.parity import TINY, Case, VariantGPT, ds_config, global_batches, micro_batch
from zeroshard.zero.stage3.prefetch import ExecutionTrace


def test_the_trace_reports_the_use_that_invalidates_it() -> None:
    trace = ExecutionTrace()
    assert not any(trace.record(u) for u in (0, 1, 2))  # nothing recorded yet: nothing to invalidate
    trace.end_step()
    assert [trace.record(u) for u in (0, 2, 1)] == [False, True, False]  # once, at the first divergence
    trace.end_step()
    assert not any(trace.record(u) for u in (0, 2, 1))  # the new order is the trace now


@pytest.mark.parametrize("enabled", [True, False])
def test_a_changed_unit_order_is_logged_when_asked(enabled: bool, log: Any) -> None:
    import zeroshard

    case = Case(stage=3, steps=3)
    torch.manual_seed(0)
    model = VariantGPT(TINY, "order")  # flips its block order on request
    config = ds_config(case)
    config["zero_optimization"]["log_trace_cache_warnings"] = enabled
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    for step, batch in enumerate(global_batches(case, 1)):
        model.flip = step == 2
        engine.backward(engine(*micro_batch(batch, 0, 0, 1, case.micro)))
        engine.step()
    engine.destroy()
    lines = [r.getMessage() for r in log.records if "prefetch trace invalidated" in r.getMessage()]
    if enabled:
        assert len(lines) == 1 and "'blocks.1'" in lines[0] and "'blocks.0'" in lines[0], lines
    else:
        assert lines == []
