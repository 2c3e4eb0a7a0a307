"""A checkpoint saved inside an accumulation window (its partial gradients are not saved) loads with the window
started again, as DeepSpeed 0.19.8's load leaves it (its TestZeROSaveLoadEdgeCase scenario; measured under both):
before, the loaded engine ended the window after one micro-batch and stepped on half a window's gradients. On 2
ranks at stages 1-3, the loaded engine's next full window gives the parameters of an engine that never saw the
interrupted window's micro-batches, to the bit."""

from __future__ import annotations

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, flat_params, global_batches, micro_batch

GAS = 2


def _micro(engine, batch, k: int, rank: int) -> None:
    x, y = micro_batch(batch, k, rank, 2, 2)
    engine.backward(engine(x, y))
    engine.step()


def _run(rank: int, world: int, stage: int, folder: str):
    import zeroshard

    case = Case(stage=stage, gas=GAS, steps=3)
    first, interrupted, after = global_batches(case, world)

    def engine():
        model = build_model(case)
        built, *_ = zeroshard.initialize(model=model, config=ds_config(case))
        return built

    reference = engine()
    for batch in (first, after):
        for k in range(GAS):
            _micro(reference, batch, k, rank)
    with reference.gathered_for_generation():
        want = flat_params(reference.module)
    saver = engine()
    for k in range(GAS):
        _micro(saver, first, k, rank)
    _micro(saver, interrupted, 0, rank)  # half of the second window
    saver.save_checkpoint(folder, tag="mid")
    loaded = engine()
    loaded.load_checkpoint(folder, tag="mid")
    counters = (loaded.global_steps, loaded.micro_steps)
    _micro(loaded, after, 0, rank)
    one = loaded.global_steps  # one micro-step into the new window: no optimizer step yet
    _micro(loaded, after, 1, rank)
    with loaded.gathered_for_generation():
        got = flat_params(loaded.module)
    for built in (reference, saver, loaded):
        built.destroy()
    return counters, one, loaded.global_steps, torch.equal(got, want)


@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow), 3])  # slow: CI budget
def test_a_save_inside_a_window_loads_with_the_window_started_again(tmp_path, stage: int) -> None:
    for rank, (counters, one, two, equal) in enumerate(run_on_ranks(_run, 2, stage, str(tmp_path))):
        assert counters == (1, GAS) and (one, two) == (1, 2), (rank, counters, one, two)
        assert equal, rank
