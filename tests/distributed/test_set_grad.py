"""DeepSpeed's gradient setters on 2 gloo ranks ([Note: setting a gradient]): every stage and gradient tier trains
as a single-process reference that edits the same gradients, and a NaN set after the boundary skips the step
wherever the shard waits (tests/helpers/set_grad_grid.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import relative_difference


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    from helpers.set_grad_grid import run_grid

    return run_on_ranks(run_grid, 2)


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by safe_set_full_grad:
# test_super_offload.py, test_tensor_parallel.py
@pytest.mark.slow
def test_set_gradients_train_as_the_reference_edits_them(ranks: list[dict]) -> None:
    from helpers.set_grad_grid import CASES, reference_params

    for name, case, _ in CASES:
        want = reference_params(case)
        for rank, result in enumerate(ranks):
            params, seen, _ = result[name]
            for step, ((read_back, applied, resident), got) in enumerate(zip(seen, params, strict=True)):
                where = f"{name} rank {rank} step {step}"
                assert read_back == 0.0, f"{where}: safe_get_full_grad read back {read_back} off the value set"
                assert applied, where
                assert resident == 0, f"{where}: {resident} gradient shards left in memory, not in their swap files"
                assert relative_difference(got, want[step]) <= 1e-6, (where, relative_difference(got, want[step]))


def test_gradients_set_in_host_copies_train_as_without_offload(ranks: list[dict]) -> None:
    """bf16 gradient shards: their fp32 host copies (stage 3: the shard released) take the values set, bit for bit
    what the run without offload steps with."""
    from helpers.set_grad_grid import COPY_CASES

    for name, case in COPY_CASES:
        for rank, result in enumerate(ranks):
            params, seen, copies = result[f"copies-{name}-cpu"]
            plain_params, plain_seen, _ = result[f"copies-{name}-none"]
            # stage 3 wrote the released shards' copies, which the step used; stages 1-2 wrote the shards, so the step
            # copied every group again (the copies made in backward were stale)
            assert copies > 0 if case.stage == 3 else copies == 0, (name, copies)
            assert seen == plain_seen and all(read == 0.0 and applied for read, applied, _ in seen), (name, seen)
            for step, (got, want) in enumerate(zip(params, plain_params, strict=True)):
                assert torch.equal(got, want), (name, rank, step, relative_difference(got, want))


def test_a_nan_set_after_the_boundary_skips_the_step(ranks: list[dict]) -> None:
    from helpers.set_grad_grid import OVERFLOW_CASES

    for name, _ in OVERFLOW_CASES:
        for rank, result in enumerate(ranks):
            unchanged, released, applied = result[f"overflow-{name}"]
            assert unchanged and not applied, (name, rank, unchanged, applied)
            assert released == (name == "stage3-cpu"), (name, "the released shard's copy is not reached")


def test_setting_a_gradient_not_reduced_yet_or_of_the_wrong_length_is_refused_in_one_line(ranks: list[dict]) -> None:
    for result in ranks:
        read0, stage0_mid, read1, stage1_mid, read_caller, caller_owned, short, long = result["refused"]
        # mid-window at stages 0-1, safe_get_full_grad is this rank's own accumulation (DeepSpeed's p.grad)
        assert max(read0, read1, read_caller) <= 1e-6, (read0, read1, read_caller)
        for message in (stage0_mid, stage1_mid, caller_owned):
            assert "safe_set_full_grad: this window's gradients are not reduced yet" in message, message
        assert "managed_gradient_accumulation false" in caller_owned, caller_owned
        assert short == "safe_set_full_grad: the gradient has 2048 elements; the value given has 2016", short
        assert long.startswith("safe_set_local_grad: ") and "values for this rank's part of" in long, long
