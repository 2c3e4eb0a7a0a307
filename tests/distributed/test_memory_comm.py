"""Per-rank model-state bytes against the ZeRO formulas, and bytes communicated per step against theory."""

from __future__ import annotations

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import (
    Case,
    build_model,
    ds_config,
    global_batches,
    micro_batch,
    param_groups,
    relative_difference,
)


def _measure(rank: int, world_size: int, cases: list[Case]):
    import zeroshard

    out = []
    for case in cases:
        model = build_model(case)
        engine, _, _, _ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        per_step = []
        for batch in global_batches(case, world_size):
            before = engine.comm_stats.snapshot()
            for k in range(case.gas):
                x, y = micro_batch(batch, k, rank, world_size, case.micro)
                engine.backward(engine(x, y))
                after_backward = engine.memory_report()
                engine.step()  # the optimizer steps at the window's last micro-step
            after = engine.comm_stats.snapshot()
            per_step.append({k: after[k]["bus_bytes"] - before[k]["bus_bytes"] for k in after})
        out.append((engine.memory_report(), after_backward, per_step))
        engine.destroy()
    return out


CASES = [Case(stage=s, steps=3, bucket=8192) for s in (0, 1, 2)] + [Case(stage=1, gas=2, steps=3, bucket=8192)]


def test_memory_and_communication_match_zero_formulas():
    world_size = 2
    results = run_on_ranks(_measure, world_size, CASES)
    for rank_result in results:
        for case, (report, after_backward, per_step) in zip(CASES, rank_result, strict=True):
            stage, psi = case.stage, report.trainable_numel
            if stage >= 1:
                # fp32 master (4) + Adam m and v (4 + 4) = 12 bytes per parameter, 1/N of them per rank
                held = report.optimizer_state + report.master_weights
                assert abs(held - 12 * psi / world_size) <= 0.01 * 12 * psi / world_size, (stage, held, psi)
            if stage == 2 or (stage == 1 and case.gas == 1):  # stage 1: [Note: stage 1's accumulator on demand]
                grads = after_backward.gradients
                assert abs(grads - 4 * psi / world_size) <= 0.01 * 4 * psi / world_size, (case.name, grads, psi)
            if stage == 1 and case.gas > 1:  # the full fp32 accumulator, its front the shard (zero/flat/reducer.py)
                assert abs(after_backward.gradients - 4 * psi) <= 0.01 * 4 * psi, (after_backward.gradients, psi)
            # every stage moves 2 * psi * 4 bytes * (N-1)/N per step (all-reduce, or reduce-scatter + all-gather)
            theory = 2 * psi * 4 * (world_size - 1) / world_size
            for step_bytes in per_step:
                total = sum(step_bytes.values())
                assert abs(total - theory) <= 0.05 * theory, (stage, step_bytes, theory)
                if stage >= 1:
                    assert step_bytes["reduce_scatter"] > 0 and step_bytes["all_gather"] > 0


def _no_sync_later(rank: int, world_size: int, how: str):
    """Stage 1 at one micro-step per window, a backward that does not communicate in its second step only (inside
    no_sync(), or after set_gradient_accumulation_boundary(False) with its own step() call); stage 0 runs the same."""
    import zeroshard

    out = {}
    for stage in (0, 1):
        case = Case(stage=stage, steps=3, bucket=8192)
        model = build_model(case)
        engine, _, _, _ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        grads, params = [], []
        for step, batch in enumerate(global_batches(case, world_size)):
            if step == 1 and how == "no_sync":
                with engine.no_sync():
                    x, y = micro_batch(batch, 1, rank, world_size, case.micro)
                    engine.backward(engine(x, y))
            if step == 1 and how == "boundary":
                engine.set_gradient_accumulation_boundary(False)
                x, y = micro_batch(batch, 1, rank, world_size, case.micro)
                engine.backward(engine(x, y))
                engine.step()  # not a boundary: no optimizer step
                engine.set_gradient_accumulation_boundary(True)
            x, y = micro_batch(batch, 0, rank, world_size, case.micro)
            engine.backward(engine(x, y))
            grads.append(engine.memory_report().gradients)
            engine.step()
            params.append(torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]))
        out[stage] = (grads, params, engine.memory_report().trainable_numel)
        engine.destroy()
    return out


@pytest.mark.parametrize("how", ["no_sync", "boundary"])
def test_stage_1_allocates_its_accumulator_when_a_backward_does_not_communicate(how: str):
    """[Note: stage 1's accumulator on demand]: the shard alone until the backward that does not communicate, then
    the full accumulator with the shard at its front; training as stage 0's, which always accumulates fully."""
    for out in run_on_ranks(_no_sync_later, 2, how):
        grads, params, psi = out[1]
        assert abs(grads[0] - 4 * psi / 2) <= 0.01 * 4 * psi / 2, (grads, psi)
        for later in grads[1:]:
            assert abs(later - 4 * psi) <= 0.01 * 4 * psi, (grads, psi)
        for mine, reference in zip(params, out[0][1], strict=True):
            assert relative_difference(mine, reference) <= 1e-6
