"""ds_config `"type": "Lamb"` ([Note: LAMB on flat shards] in optim/lamb.py): stages 0-3 on 2 gloo ranks against a
single process stepping the same LAMB over the model's own parameters, every step, with parameters cut across the
ranks' shards (small buckets, stage 3's sub-groups and persistent unit, CPU offload, accumulation and clipping); a
step's trust ratios differ from per-shard ones (what LAMB on flat shards computed without the plan); refusals name
what LAMB cannot run with."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import (
    Case,
    build_model,
    ds_config,
    engine_run,
    flat_params,
    global_batches,
    micro_batch,
    param_groups,
    ranks_threads,
    relative_difference,
    save_and_resume,
)

PARAMS = {"lr": 2e-3, "weight_decay": 0.01, "max_coeff": 10.0, "min_coeff": 0.01}  # FusedLamb's coefficient range
CASES = [
    Case(stage=0, steps=3),
    Case(stage=1, steps=3, bucket=1000),  # every parameter of the tiny GPT cut across both ranks' shards
    Case(stage=2, steps=3, bucket=1000, gas=2),
    Case(stage=3, steps=3),
    Case(stage=3, steps=3, sub_group=3000, persistence=100),  # sub-groups stepped alone, the persistent unit
    Case(stage=1, steps=3, offload="cpu"),
    Case(stage=3, steps=3, offload="cpu", offload_param="cpu"),
]


# the fsdp2 backend: each master is one parameter's rows (zero/norms.py ShardNormPlan), on the device and offloaded
FSDP2 = [Case(stage=3, steps=3), Case(stage=3, steps=3, gas=2, offload="cpu", offload_param="cpu")]


def _config(case: Case) -> dict[str, Any]:
    config = ds_config(case)
    config["optimizer"] = {"type": "Lamb", "params": dict(PARAMS, lr=case.lr)}
    return config


def _train(
    rank: int, world_size: int, cases: list[Case], backend: str = "zero"
) -> list[tuple[list[float], list[torch.Tensor]]]:
    out = []
    for case in cases:
        configure = lambda config, case=case: {**_config(case), "zeroshard": {"backend": backend}}  # noqa: E731
        losses, values, _ = engine_run(rank, world_size, case, configure=configure)
        out.append((losses, values))
    return out


def _reference(case: Case, world_size: int) -> tuple[list[float], list[torch.Tensor]]:
    """One process, the whole global batch, `clip_grad_norm_`, then LAMB over the model's own parameters."""
    from zeroshard.optim.lamb import Lamb

    model = build_model(case)
    optimizer = Lamb(param_groups(model, case), lr=case.lr, **{k: v for k, v in PARAMS.items() if k != "lr"})
    losses, values = [], []
    n_micro = world_size * case.gas
    for batch in global_batches(case, world_size):
        optimizer.zero_grad()
        total = 0.0
        for k in range(case.gas):
            for r in range(world_size):
                loss = model(*micro_batch(batch, k, r, world_size, case.micro))
                total += loss.item() / n_micro
                (loss / n_micro).backward()
        if case.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        optimizer.step()
        losses.append(total)
        values.append(flat_params(model))
    return losses, values


@pytest.mark.parametrize(
    "backend, cases", [("zero", CASES), pytest.param("fsdp2", FSDP2, marks=pytest.mark.slow)], ids=["zero", "fsdp2"]
)  # CI budget: the default suite in 15 minutes on 2 AVX2 cores
def test_lamb_equals_a_single_process(backend: str, cases: list[Case]) -> None:
    results = run_on_ranks(_train, 2, cases, backend)
    for i, case in enumerate(cases):
        with ranks_threads():
            want_losses, want_values = _reference(case, 2)
        for rank_result in results:
            for step, (got, want) in enumerate(zip(rank_result[i][1], want_values, strict=True)):
                assert relative_difference(got, want) <= 1e-6, (case.name, step, relative_difference(got, want))
        losses = [sum(values) / len(values) for values in zip(*(r[i][0] for r in results), strict=True)]
        assert losses == pytest.approx(want_losses, rel=1e-6), case.name  # the ranks' mean: the global batch's


def test_per_parameter_trust_ratios_are_not_per_shard() -> None:
    """The parity above needs whole-parameter norms: LAMB over two halves of each parameter (a shard's view without
    the plan) moves the weights differently after one step."""
    from zeroshard.optim.lamb import Lamb

    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(64))
    halves = [torch.nn.Parameter(whole.detach()[:32].clone()), torch.nn.Parameter(whole.detach()[32:].clone())]
    grad = torch.cat([torch.full((32,), 1.0), torch.full((32,), 1e-3)])
    whole.grad, halves[0].grad, halves[1].grad = grad, grad[:32].clone(), grad[32:].clone()
    Lamb([whole], lr=0.1, max_coeff=10.0).step()
    Lamb(halves, lr=0.1, max_coeff=10.0).step()
    assert relative_difference(torch.cat([h.detach() for h in halves]), whole.detach()) > 1e-4  # parity: 1e-6


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"optimizer": {"type": "Lamb", "params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),
        ({"optimizer": {"type": "Lamb", "params": {"trust": 1.0}}}, "optimizer.params.trust"),
        (
            {
                "gradient_clipping": 0.0,  # (with clipping, super_offload steps after backward: nothing to undo)
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}},
            },
            "optimizer.type is 'Lamb': use Adam/AdamW or set super_offload false",
        ),
    ],
)
def test_lamb_refusals_name_the_reason(extra: dict, message: str) -> None:
    results = run_on_ranks(_refused, 2, extra)
    assert all(message in r for r in results), results


def _refused(rank: int, world_size: int, extra: dict) -> str:
    import zeroshard

    case = Case(stage=3, steps=1)
    config = _config(case)
    config.update(extra)
    model = build_model(case)
    try:
        zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    except Exception as e:  # noqa: BLE001 - the message is the test
        return str(e)
    return "accepted"


def _resume(rank: int, world_size: int, directory: str, saver: Case, loader: Case) -> list[list[torch.Tensor]]:
    """LAMB's moments and step counts come back into another layout."""
    return save_and_resume(rank, world_size, directory, saver, loader, _config)


def test_lamb_state_resumes_in_another_layout(tmp_path) -> None:
    saver, loader = Case(stage=3, steps=4, clip=0.0, sub_group=3000), Case(stage=1, steps=4, bucket=1000, clip=0.0)
    for continued, resumed in run_on_ranks(_resume, 2, str(tmp_path), saver, loader):
        for got, want in zip(resumed, continued, strict=True):
            assert relative_difference(got, want) <= 1e-6
