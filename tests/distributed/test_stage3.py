"""ZeRO-3 against the single-process reference, and its memory, communication and robustness."""

from __future__ import annotations

from test_parity import _check

from helpers.harness import run_on_ranks
from helpers.parity import Case, engine_run

CASES_2 = [Case(stage=3, dtype=d, gas=g) for d in ("fp32", "bf16") for g in (1, 3)] + [
    Case(stage=3, persistence=10**6),  # everything persistent (stage-2-like)
    Case(stage=3, persistence=2000),  # mixed: small parameters persistent, matrices sharded
    Case(stage=3, reuse=10**9, prefetch=10**9),  # DeepSpeed's defaults: keep and prefetch everything
    Case(stage=3, variant="frozen"),
    Case(stage=3, variant="unused"),
    Case(stage=3, variant="twice"),
    Case(stage=3, variant="unused_unit"),
    Case(stage=3, variant="order"),
    Case(stage=3, variant="eval"),
]
CASES_4 = [Case(stage=3), Case(stage=3, gas=3, persistence=2000)]


def _run_cases(rank: int, world_size: int, cases: list[Case]):
    return [engine_run(rank, world_size, case) for case in cases]


def test_stage3_parity_two_ranks():
    _check(CASES_2, run_on_ranks(_run_cases, 2, CASES_2), 2)


def test_stage3_parity_four_ranks():
    _check(CASES_4, run_on_ranks(_run_cases, 4, CASES_4), 4)
