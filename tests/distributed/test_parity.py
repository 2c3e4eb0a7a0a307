"""Stages 0/1/2 against a single-process reference: same seed, same global batch, every step."""

from __future__ import annotations

import pytest

from helpers.harness import run_on_ranks
from helpers.parity import Case, engine_run, reference_run, relative_difference

# [Note: bf16 tolerance]
# bf16 keeps 8 significant bits (relative rounding 2**-9 ~ 2e-3). The engine reduces gradients in
# bf16 (DeepSpeed's default communication dtype) and each rank's bf16 backward sees a different
# micro-batch split than the reference's, so per-step gradients differ by a few bf16 ulps. Losses
# are compared at 1e-2 relative and parameters at 1e-2 of their largest magnitude: an lr 2e-3
# AdamW update moves a parameter by ~2e-3 per step, so a wrong reduction (e.g. a missing 1/N or a
# dropped bucket) shows up well above that bound.
TOL = {"fp32": (1e-6, 1e-6), "bf16": (1e-2, 1e-2)}

CASES_2 = (
    [Case(stage=s, dtype=d, gas=g) for s in (0, 1, 2) for d in ("fp32", "bf16") for g in (1, 3)]
    + [Case(stage=s, variant=v) for s in (1, 2) for v in ("frozen", "unused")]
    + [Case(stage=0, variant="unused"), Case(stage=0, variant="frozen")]
    # a small bucket (the unused layer's weight) before a larger one: rank 0's reduced slice of the second bucket
    # overlaps where it moves to in the shard ([Note: stage 1's shard inside its accumulator])
    + [Case(stage=1, gas=3, variant="unused", bucket=1000)]
    + [Case(stage=1, variant="unused", bucket=1000, reduce_scatter=False)]
)

CASES_4 = [Case(stage=2, gas=1), Case(stage=1, gas=3)]


def _run_cases(rank: int, world_size: int, cases: list[Case]):
    return [engine_run(rank, world_size, case) for case in cases]


def _check(cases: list[Case], per_rank, world_size: int) -> None:
    failures = []
    for i, case in enumerate(cases):
        ref_losses, ref_params = reference_run(case, world_size)
        loss_tol, param_tol = TOL[case.dtype]
        rank_losses = [per_rank[r][i][0] for r in range(world_size)]
        for step in range(case.steps):
            loss = sum(losses[step] for losses in rank_losses) / world_size
            rel = abs(loss - ref_losses[step]) / abs(ref_losses[step])
            if rel > loss_tol:
                failures.append(
                    f"{case.name} step {step}: loss {loss!r} vs reference {ref_losses[step]!r} (rel {rel:.2e})"
                )
            for r in range(world_size):
                p_rel = relative_difference(per_rank[r][i][1][step], ref_params[step])
                if p_rel > param_tol:
                    failures.append(f"{case.name} step {step} rank {r}: params rel diff {p_rel:.2e}")
                    break
        for r in range(1, world_size):
            assert (per_rank[r][i][1][-1] == per_rank[0][i][1][-1]).all(), f"{case.name}: ranks disagree"
    assert not failures, "\n".join(failures[:20])


def test_parity_two_ranks():
    per_rank = run_on_ranks(_run_cases, 2, CASES_2)
    _check(CASES_2, per_rank, 2)


def test_parity_four_ranks():
    per_rank = run_on_ranks(_run_cases, 4, CASES_4)
    _check(CASES_4, per_rank, 4)


@pytest.mark.parametrize("stage", [0, 2])
def test_single_process_matches_reference(stage):
    """World size 1, no launcher variables: the same code path as `python train.py`."""
    per_rank = run_on_ranks(_run_cases, 1, [Case(stage=stage, gas=2)])
    _check([Case(stage=stage, gas=2)], per_rank, 1)
