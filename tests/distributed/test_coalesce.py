"""`engine.coalesce_grad_reduction()` ([Note: coalesced gradient reduction] in zero/strategy.py): three backwards in
a block, one step after it, at stages 1-3, equal a single-process reference and DeepSpeed 0.19.8's coalesced block
within 1e-6; the backwards communicate nothing and leaving the block reduces once."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, flat_params, param_groups, relative_difference
from helpers.windows import batches, mine, reference_windows

BLOCKS = [3, 3, 3]  # micro-batches per block (gradient_accumulation_steps 1: one step per block)
CASES = [Case(stage=1), Case(stage=2), Case(stage=3), Case(stage=3, offload="cpu", offload_param="cpu")]


def _reduced_bytes(engine: Any) -> float:
    """zeroshard's gradient-reduction bytes (DeepSpeed's engine counts none: 0)."""
    kinds = engine.comm_stats.kinds if hasattr(engine, "comm_stats") else None
    return sum(kinds[k].bus_bytes for k in ("reduce_scatter", "all_reduce")) if kinds is not None else 0.0


def _train(rank: int, world_size: int, engine: Any, gathered: Any) -> tuple[Any, ...]:
    losses, inside, flushed = [], [], []
    for block in batches(world_size, BLOCKS):
        with engine.coalesce_grad_reduction():
            before = _reduced_bytes(engine)
            for batch in block:
                loss = engine(*mine(batch, rank))
                engine.backward(loss)
                losses.append(loss.item())
            inside.append(_reduced_bytes(engine) - before)
        flushed.append(_reduced_bytes(engine) - before)
        engine.step()
    with gathered(list(engine.module.parameters())):
        params = flat_params(engine.module)
    before = _reduced_bytes(engine)  # one backward outside a block, for its reduction's bytes
    engine.backward(engine(*mine(batches(world_size, [1])[0][0], rank)))
    single = _reduced_bytes(engine) - before
    return losses, params, inside, flushed, single


def _run(rank: int, world_size: int) -> list[Any]:
    import zeroshard

    out = []
    for case in CASES:
        model, config = build_model(case), ds_config(case)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        out.append(_train(rank, world_size, engine, zeroshard.GatheredParameters))
        engine.destroy()
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    for case in CASES[:3]:
        model, config = build_model(case), ds_config(case)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        out.append(_train(rank, world_size, engine, deepspeed.zero.GatheredParameters))
        engine.destroy()
    return out


def _reference(world_size: int, case: Case) -> tuple[list[float], torch.Tensor]:
    """Each block's losses summed (gradient_accumulation_steps 1)."""
    return reference_windows(world_size, case, BLOCKS, lambda length: 1)


def test_a_coalesced_block_trains_as_the_reference_and_deepspeed() -> None:
    results = run_on_ranks(_run, 2, timeout=900)
    for i, case in enumerate(CASES):
        _, ref_params = _reference(2, case)
        for per_rank in results:
            losses, params, inside, flushed, single = per_rank[i]
            assert relative_difference(params, ref_params) < 1e-6, case.name
            assert inside == [0.0] * len(BLOCKS), (case.name, inside)  # nothing reduced inside a block
            if case.stage >= 2:  # leaving a block reduces once: one backward's bytes, not three
                assert flushed == [single] * len(BLOCKS), (case.name, flushed, single)
            else:  # stage 1 reduces on the boundary anyway: the block's reduction is the step's
                assert all(f > 0 for f in flushed), case.name
            if i < 3:
                theirs = per_rank[len(CASES) + i]
                assert relative_difference(params, theirs[1]) < 1e-6, case.name
                assert torch.allclose(torch.tensor(losses), torch.tensor(theirs[0]), rtol=1e-6), case.name


def _refusals(rank: int, world_size: int) -> list[str]:
    import zeroshard

    messages = []
    for case, extra in [
        (Case(stage=0), {}),
        (Case(stage=2), {"managed_gradient_accumulation": False}),
        (Case(stage=3), {"zeroshard": {"backend": "fsdp2"}}),
    ]:
        model, config = build_model(case), {**ds_config(case), **extra}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        with pytest.raises(zeroshard.ZeroshardError, match="coalesce_grad_reduction is not supported here") as e:
            with engine.coalesce_grad_reduction():
                pass
        messages.append(str(e.value))
        engine.destroy()
    case = Case(stage=2)
    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    x, y = mine(batches(world_size, [1])[0][0], rank)
    with pytest.raises(zeroshard.ZeroshardError, match="inside coalesce_grad_reduction"):
        with engine.coalesce_grad_reduction():
            engine.backward(engine(x, y))
            engine.step()
    engine.backward(engine(x, y))  # the failed block's gradients were dropped: the engine trains on
    engine.step()
    engine.destroy()
    case = Case(stage=1)  # no_sync() is a stage 0/1 context: inside the block it is refused, as DeepSpeed's
    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    with pytest.raises(zeroshard.ZeroshardError, match="no_sync\\(\\) inside coalesce_grad_reduction"):
        with engine.coalesce_grad_reduction():
            with engine.no_sync():
                pass
    engine.destroy()
    return messages


def test_coalescing_refusals() -> None:
    messages = run_on_ranks(_refusals, 2)[0]
    assert "stage 0" in messages[0] and "managed_gradient_accumulation" in messages[1] and "fsdp2" in messages[2]


def _edges(rank: int, world_size: int) -> list[Any]:
    """A block off the accumulation boundary (gradient_accumulation_steps 2: the flush reduces anyway, as
    DeepSpeed's), and engine.zero_grad() inside a block (the gradients before it are dropped), each against the
    same training without a block."""
    import zeroshard

    data = batches(world_size, [1] * 8)
    out = []
    for stage in (1, 2, 3):
        runs = []
        for coalesce in (False, True):
            case = Case(stage=stage, gas=2)
            model, config = build_model(case), ds_config(case)
            engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
            for i in range(0, 8, 2):  # per optimizer step: two micro-steps, the first one's backward in a block
                block = engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext()
                with block:
                    engine.backward(engine(*mine(data[i + 1][0], rank)))
                    engine.zero_grad()  # drops that backward's gradients, in a block or not
                    engine.backward(engine(*mine(data[i][0], rank)))
                engine.step()
                engine.backward(engine(*mine(data[i + 1][0], rank)))
                engine.step()
            with zeroshard.GatheredParameters(list(engine.module.parameters())):
                runs.append(flat_params(engine.module))
            engine.destroy()
        for coalesce in (False, True):  # the window's backwards in a block at its first micro-step, or at its last
            case = Case(stage=stage, gas=2)
            model, config = build_model(case), ds_config(case)
            engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
            for i in range(0, 8, 2):
                if not coalesce:
                    engine.step()
                with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
                    engine.backward(engine(*mine(data[i][0], rank)))
                    engine.backward(engine(*mine(data[i + 1][0], rank)))
                engine.step()
                if coalesce:
                    engine.step()  # the window's last micro-step, with no backward of its own
            with zeroshard.GatheredParameters(list(engine.module.parameters())):
                runs.append(flat_params(engine.module))
            engine.destroy()
        out.append(runs)
    return out


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by coalescing:
# test_a_coalesced_block_trains_as_the_reference_and_deepspeed
@pytest.mark.slow
def test_a_block_off_the_boundary_and_zero_grad_inside_a_block() -> None:
    for per_rank in run_on_ranks(_edges, 2):
        for stage, (plain, coalesced, at_boundary, first) in zip((1, 2, 3), per_rank, strict=True):
            assert relative_difference(coalesced, plain) < 1e-6, stage
            assert relative_difference(first, at_boundary) < 1e-6, stage
