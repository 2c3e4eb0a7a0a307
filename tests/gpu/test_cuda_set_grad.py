"""DeepSpeed's gradient setters on CUDA ([Note: setting a gradient]): fp32 gradient shards on the GPU with host
masters, so the offloaded tiers make real pinned host copies on the side stream (stage 3 releases its shards into
them), against the same single-process reference as on the CPU (tests/helpers/set_grad_grid.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import relative_difference

pytestmark = pytest.mark.cuda

WORLD_SIZES = [1, 2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [1]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_set_gradients_on_cuda_train_as_the_reference_edits_them(world_size: int) -> None:
    from helpers.set_grad_grid import CASES, COPY_CASES, OVERFLOW_CASES, reference_params, run_grid

    ranks = run_on_ranks(run_grid, world_size)
    for name, case, _ in CASES:
        want = reference_params(case, world_size)
        for rank, result in enumerate(ranks):
            params, seen, copies = result[name]
            if case.offload == "cpu":  # on CUDA every offloaded tier copies gradients to the host in backward
                assert copies > 0 or case.stage < 3, (name, copies)
            for step, ((read_back, applied, resident), got) in enumerate(zip(seen, params, strict=True)):
                where = f"{name} rank {rank} step {step}"
                assert read_back == 0.0 and applied and resident == 0, (where, read_back, applied, resident)
                assert relative_difference(got, want[step]) <= 1e-6, (where, relative_difference(got, want[step]))
    for name, _ in COPY_CASES:
        for result in ranks:
            plain, offloaded = result[f"copies-{name}-none"], result[f"copies-{name}-cpu"]
            assert all(torch.equal(a, b) for a, b in zip(plain[0], offloaded[0], strict=True)), name
    for name, _ in OVERFLOW_CASES:
        for result in ranks:
            unchanged, released, applied = result[f"overflow-{name}"]
            assert unchanged and not applied, (name, unchanged, applied)
    assert all(len(result["refused"]) == 8 for result in ranks)
