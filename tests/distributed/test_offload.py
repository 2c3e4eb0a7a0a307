"""Offload: every offloaded configuration gives the same losses and parameters as without offload."""

from __future__ import annotations

from test_parity import _check

from helpers.harness import run_on_ranks
from helpers.parity import Case, engine_run

CASES = [
    Case(stage=1, offload="cpu"),
    Case(stage=2, offload="cpu", gas=3),
    Case(stage=3, offload="cpu"),
    Case(stage=3, offload_param="cpu"),
    Case(stage=3, offload="cpu", offload_param="cpu", gas=3),
    Case(stage=2, offload="cpu", dtype="bf16"),
    Case(stage=3, offload="cpu", offload_param="cpu", dtype="bf16"),
]


def _run(rank: int, world_size: int, cases: list[Case]):
    return [engine_run(rank, world_size, case) for case in cases]


def test_offload_parity_and_placement():
    per_rank = run_on_ranks(_run, 2, CASES)
    _check(CASES, per_rank, 2)
    for i, case in enumerate(CASES):
        report = per_rank[0][i][2]
        if case.offload == "cpu":  # the device tier holds no optimizer state or master weights
            assert report.optimizer_state == 0 and report.master_weights == 0, (case.name, report)
            psi_n = report.trainable_numel / 2
            assert abs(report.host_optimizer_state - 8 * psi_n) <= 0.02 * 8 * psi_n, (case.name, report)
            shared = case.offload_param == "cpu" and case.dtype == "fp32"  # one fp32 host shard is both
            master = report.host_params if shared else report.host_master_weights
            assert abs(master - 4 * psi_n) <= 0.02 * 4 * psi_n, (case.name, report)
        if case.offload_param == "cpu":
            assert report.params == 0 and report.host_params > 0, (case.name, report)


def _offload_states_round_trip(rank: int, world_size: int):
    import torch

    import zeroshard
    from helpers.parity import build_model, ds_config, global_batches, micro_batch, param_groups

    results = {}
    for stage in (2, 3):
        runs = []
        for offload_between in (False, True):
            case = Case(stage=stage, steps=4)
            model = build_model(case)
            engine, _, _, _ = zeroshard.initialize(
                model=model, model_parameters=param_groups(model, case), config=ds_config(case)
            )
            losses, freed, refused = [], None, False
            for step, batch in enumerate(global_batches(case, world_size)):
                x, y = micro_batch(batch, 0, rank, world_size, case.micro)
                if offload_between and step == 2:
                    engine.offload_states()
                    freed = all(t.untyped_storage().nbytes() == 0 for t in engine.zero.offloadable_tensors())
                    with torch.no_grad():
                        engine(x, y)  # evaluation while offloaded
                    try:
                        engine.step()
                    except zeroshard.ZeroshardError:
                        refused = True
                    engine.reload_states()
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            engine.destroy()
            runs.append((losses, freed, refused))
        results[stage] = runs
    return results


def test_offload_states_and_reload_continue_bit_identically():
    for result in run_on_ranks(_offload_states_round_trip, 2):
        for stage, ((plain, _, _), (offloaded, freed, refused)) in result.items():
            assert freed and refused, stage
            assert plain == offloaded, (stage, plain, offloaded)
