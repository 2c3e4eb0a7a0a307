"""Per-rank model-state bytes against the ZeRO formulas, and bytes communicated per step against theory."""

from __future__ import annotations

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups


def _measure(rank: int, world_size: int, stages: list[int]):
    import zeroshard

    out = {}
    for stage in stages:
        case = Case(stage=stage, steps=3, bucket=8192)
        model = build_model(case)
        engine, _, _, _ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        per_step = []
        for batch in global_batches(case, world_size):
            before = engine.comm_stats.snapshot()
            x, y = micro_batch(batch, 0, rank, world_size, case.micro)
            engine.backward(engine(x, y))
            after_backward = engine.memory_report()
            engine.step()
            after = engine.comm_stats.snapshot()
            per_step.append({k: after[k]["bus_bytes"] - before[k]["bus_bytes"] for k in after})
        out[stage] = (engine.memory_report(), after_backward, per_step)
        engine.destroy()
    return out


def test_memory_and_communication_match_zero_formulas():
    world_size = 2
    results = run_on_ranks(_measure, world_size, [0, 1, 2])
    for rank_result in results:
        for stage, (report, after_backward, per_step) in rank_result.items():
            psi = report.trainable_numel
            if stage >= 1:
                # fp32 master (4) + Adam m and v (4 + 4) = 12 bytes per parameter, 1/N of them per rank
                held = report.optimizer_state + report.master_weights
                assert abs(held - 12 * psi / world_size) <= 0.01 * 12 * psi / world_size, (stage, held, psi)
            if stage == 2:
                assert abs(after_backward.gradients - 4 * psi / world_size) <= 0.01 * 4 * psi / world_size
            if stage == 1:  # the full fp32 accumulator, whose front is the shard (zero/flat/reducer.py)
                assert abs(after_backward.gradients - 4 * psi) <= 0.01 * 4 * psi, (after_backward.gradients, psi)
            # every stage moves 2 * psi * 4 bytes * (N-1)/N per step (all-reduce, or reduce-scatter + all-gather)
            theory = 2 * psi * 4 * (world_size - 1) / world_size
            for step_bytes in per_step:
                total = sum(step_bytes.values())
                assert abs(total - theory) <= 0.05 * theory, (stage, step_bytes, theory)
                if stage >= 1:
                    assert step_bytes["reduce_scatter"] > 0 and step_bytes["all_gather"] > 0
