"""Windows the script ends (`managed_gradient_accumulation: false`, [Note: caller-owned windows]) on CUDA: stage 1's
reduction at the step runs on the device, and the offloaded tiers' gradient shards go to pinned host buffers at the
step instead of during a last backward. Bit-identical to the managed engine, as on the CPU
(tests/distributed/test_managed_accumulation.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case
from helpers.windows import check_same_as_managed, same_as_managed

pytestmark = pytest.mark.cuda

WORLD_SIZES = [1, 2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [1]
CASES = [
    (Case(stage=1, gas=2, steps=3), {"zero_optimization": {"overlap_comm": True}}),
    (Case(stage=1, gas=2, steps=3, dtype="bf16", offload="cpu"), {}),
    (Case(stage=2, gas=2, steps=3, offload="cpu"), {}),
    (Case(stage=3, gas=2, steps=3, dtype="bf16"), {}),
    (Case(stage=3, gas=2, steps=3, offload="cpu", offload_param="cpu"), {}),
]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_windows_the_script_ends_train_as_the_managed_engine_on_cuda(world_size: int) -> None:
    check_same_as_managed(CASES, run_on_ranks(same_as_managed, world_size, CASES))
