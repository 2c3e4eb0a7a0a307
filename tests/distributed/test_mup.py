"""ds_config "MuAdam" / "MuAdamW" / "MuSGD" ([Note: muP on flat shards] in optim/regroup.py) on 2 gloo ranks against a
single process stepping torch's optimizer with one group per parameter, lr and weight decay scaled by mup's formulas,
every step (fp32, 1e-6 as every parity test). The tiny GPT's parameters carry the `infshape` that
`mup.set_base_shapes` would attach against the same GPT at a quarter of the width (helpers/mup_shapes.py). Measured
once beside it (the mup package cannot be installed on the test machine: it needs torchvision): with mup 1.0.0's own
`set_base_shapes` and `MuReadout`, MuAdamW at stages 1 and 3, MuAdam and MuSGD at stage 2 give DeepSpeed 0.19.8's
losses to every printed digit."""

from __future__ import annotations

import functools

import pytest

from helpers.harness import run_on_ranks
from helpers.mup_shapes import build_mup_model, reference_optimizer, with_optimizer
from helpers.parity import Case, engine_run, ranks_threads, reference_run, relative_difference

# (type, case[, backend]): the fsdp2 backend's parameters carry the `infshape`s too
CASES: list[tuple] = [
    ("MuAdamW", Case(stage=0, steps=3)),
    ("MuAdamW", Case(stage=1, steps=3, bucket=1000)),
    ("MuAdamW", Case(stage=2, steps=3, gas=2)),
    ("MuAdamW", Case(stage=3, steps=3, sub_group=3000)),
    ("MuAdamW", Case(stage=3, steps=3, offload="cpu", offload_param="cpu")),
    ("MuAdam", Case(stage=2, steps=3)),
    ("MuSGD", Case(stage=1, steps=3, lr=0.05)),
    ("MuSGD", Case(stage=3, steps=3, lr=0.05)),
    ("MuAdamW", Case(stage=3, steps=3), "fsdp2"),
    ("MuSGD", Case(stage=2, steps=3, lr=0.05), "fsdp2"),
]


def _train(rank: int, world_size: int, cases: list[tuple]):
    out = []
    for type_name, case, *backend in cases:
        configure = functools.partial(with_optimizer, type_name, backend=backend[0] if backend else "zero")
        losses, params, _ = engine_run(rank, world_size, case, configure=configure, build=build_mup_model)
        out.append((losses, params))
    return out


def test_mup_optimizers_equal_a_single_process_with_the_scaled_groups() -> None:
    results = run_on_ranks(_train, 2, CASES)
    for i, (type_name, case, *_) in enumerate(CASES):
        with ranks_threads():
            want_losses, want_params = reference_run(
                case, 2, optimizer_for=functools.partial(reference_optimizer, type_name)
            )
        for rank in range(2):
            losses, params = results[rank][i]
            for step, (got, want) in enumerate(zip(params, want_params, strict=True)):
                diff = relative_difference(got, want)
                assert diff < 1e-6, f"{type_name} {case.name} rank {rank} step {step}: {diff:.2e}"
        mean = [(a + b) / 2 for a, b in zip(results[0][i][0], results[1][i][0], strict=True)]
        assert mean == pytest.approx(want_losses, rel=1e-6), f"{type_name} {case.name}"


def _without_infshape(rank: int, world_size: int):
    import zeroshard
    from helpers.parity import build_model, ds_config

    case = Case(stage=2, steps=1)
    try:
        zeroshard.initialize(model=build_model(case), config=with_optimizer("MuAdamW", ds_config(case)))
    except zeroshard.ConfigError as err:
        return str(err)
    return None


def test_a_model_without_base_shapes_is_refused_naming_the_parameter() -> None:
    messages = run_on_ranks(_without_infshape, 2)
    assert all(m is not None and "has no `infshape`" in m and "mup.set_base_shapes" in m for m in messages), messages
