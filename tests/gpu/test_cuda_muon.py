"""Muon on CUDA ([Note: Muon on flat shards] in optim/muon.py): Newton-Schulz in fp16 ("gram") and bf16 ("standard")
on the GPU, at stages 0-3 and with the optimizer state on the host (its matrices still orthogonalised on the GPU:
on the host they would iterate in fp32 and differ from the reference by fp16's rounding), against a CUDA single
process stepping the same optimizer over the model's parameters (helpers/muon.py). With 2 GPUs the exchange runs
over NCCL."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.muon import PARAMS, muon_config, reference
from helpers.parity import Case, flat_params, global_batches, micro_batch, param_groups, relative_difference

pytestmark = pytest.mark.cuda

WORLD_SIZES = [1, 2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [1]
CASES = [
    Case(stage=0, steps=3, clip=0.0),
    Case(stage=2, steps=3, bucket=1000, clip=0.0),
    Case(stage=3, steps=3, clip=0.0),
    Case(stage=2, steps=3, clip=0.0, offload="cpu"),
    Case(stage=3, steps=3, clip=0.0, offload="cpu", offload_param="cpu"),
]
METHODS = ["gram", "standard"]


def _run(rank: int, world_size: int, method: str) -> list[list[torch.Tensor]]:
    import zeroshard
    from helpers.parity import build_model

    out = []
    for case in CASES:
        model = build_model(case)
        config = muon_config(case, {**PARAMS, "ns_method": method})
        engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        values = []
        for batch in global_batches(case, world_size):
            x, y = micro_batch(batch, 0, rank, world_size, case.micro)
            engine.backward(engine(x.to(engine.device), y.to(engine.device)))
            engine.step()
            with zeroshard.GatheredParameters(list(engine.module.parameters())):
                values.append(flat_params(engine.module))
        out.append(values)
        engine.destroy()
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_muon_on_cuda_equals_a_cuda_single_process(world_size: int, method: str) -> None:
    results: list[Any] = run_on_ranks(_run, world_size, method)
    for i, case in enumerate(CASES):
        _, want = reference(case, world_size, {**PARAMS, "ns_method": method}, device="cuda")
        for per_rank in results:
            for step, (got, expected) in enumerate(zip(per_rank[i], want, strict=True)):
                # the same kernels on the same matrices; 1e-5 leaves room for a reduction order, not for fp32 vs fp16
                assert relative_difference(got, expected) <= 1e-5, (case.name, method, step)
