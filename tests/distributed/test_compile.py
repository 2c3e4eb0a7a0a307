"""`engine.compile()` (DeepSpeed's): the module compiled in place with torch.compile, training equal to the
single-process reference at every stage and on the fsdp2 backend; stage 3's gathering hooks run eagerly between
compiled units ([Note: hooks under torch.compile]). The default suite uses the `aot_eager` backend (dynamo and
AOTAutograd, no C++ compiler); the `slow` test runs the default, inductor."""

from __future__ import annotations

import pytest

from helpers.harness import run_on_ranks
from helpers.parity import Case, engine_run, reference_run, relative_difference

TOL = 1e-6
CASES = [Case(stage=2, steps=3), Case(stage=3, variant="deep", steps=3)]  # flat buffers; stage 3's disabled hooks
MORE_CASES = [Case(stage=0, steps=3), Case(stage=3, steps=3)]


def _fsdp2(config: dict) -> dict:
    return {**config, "zeroshard": {"backend": "fsdp2"}}


def _compile(backend: str):
    def prepare(engine) -> None:
        engine.compile(backend=backend)
        assert engine.is_compiled
        engine.compile(backend=backend)  # a second call does nothing

    return prepare


def _compiled_runs(rank: int, world_size: int, backend: str, cases: list[Case], fsdp2: bool):
    import torch._dynamo

    out = []
    for case in cases:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        losses, params, _ = engine_run(rank, world_size, case, _fsdp2 if fsdp2 else None, _compile(backend))
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        out.append((losses, params, graphs))
    return out


def _check(cases: list[Case], per_rank: list, world_size: int, tol: float = TOL) -> None:
    """Every case: the mean of the ranks' losses and rank 0's parameters against the reference, every step."""
    for i, case in enumerate(cases):
        _, params, graphs = per_rank[0][i]
        assert graphs > 0, f"{case.name}: nothing was compiled"
        losses = [sum(step) / world_size for step in zip(*(rank[i][0] for rank in per_rank), strict=True)]
        ref_losses, ref_params = reference_run(case, world_size)
        for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) <= tol * abs(b), (case.name, step, a, b)
        for step, (p, q) in enumerate(zip(params, ref_params, strict=True)):
            assert relative_difference(p, q) <= tol, (case.name, step, relative_difference(p, q))


@pytest.mark.slow  # default-suite budget: moved 2026-11-25 (seventeenth session)
def test_compiled_engine_matches_the_reference() -> None:
    _check(CASES, run_on_ranks(_compiled_runs, 2, "aot_eager", CASES, False, timeout=600), 2)


# slow: stage 0 and the shallow stage-3 model, secondary to the cases above (the default suite's budget: 864 s of
# 900 measured on 2026-11-24, this test 26 s of it with all four)
@pytest.mark.slow
def test_compiled_engine_matches_the_reference_at_the_other_stages() -> None:
    _check(MORE_CASES, run_on_ranks(_compiled_runs, 2, "aot_eager", MORE_CASES, False, timeout=600), 2)


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by compile: the zero backend's test in
# this file
@pytest.mark.slow
def test_compiled_engine_on_the_fsdp2_backend() -> None:
    cases = [Case(stage=3, steps=3)]
    _check(cases, run_on_ranks(_compiled_runs, 2, "aot_eager", cases, True, timeout=600), 2)


@pytest.mark.slow
def test_inductor_compiled_stage3_matches_the_reference() -> None:
    """Inductor fuses kernels, so the sums round differently: 1e-5 (the bf16 parity tests' reasoning, at fp32)."""
    cases = [Case(stage=3, steps=3)]
    _check(cases, run_on_ranks(_compiled_runs, 2, "inductor", cases, False, timeout=900), 2, tol=1e-5)


def _refused(rank: int, world_size: int) -> list[str]:
    import zeroshard

    case = Case(stage=1, steps=1)
    from helpers.parity import build_model, ds_config

    engine, _, _, _ = zeroshard.initialize(model=build_model(case), config=ds_config(case))
    messages = []
    try:
        engine.compile(backend="aot_eager", compiled_autograd_enabled=True)
    except zeroshard.ZeroshardError as err:
        messages.append(str(err))
    assert not engine.is_compiled
    engine.compile(backend="aot_eager", schedule=[(0, [])])  # DeepCompile's, ignored as DeepSpeed does without it
    assert engine.is_compiled
    return messages


def test_compiled_autograd_is_refused_and_a_deepcompile_schedule_ignored() -> None:
    (messages,) = run_on_ranks(_refused, 1)
    assert len(messages) == 1 and "compiled_autograd_enabled" in messages[0], messages
