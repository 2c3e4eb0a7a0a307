"""`managed_gradient_accumulation: false` ([Note: caller-owned windows]): the script ends each window with
`engine.step()` after any number of `engine.backward` calls. Windows of `gradient_accumulation_steps` micro-batches
train bit for bit as the managed engine does, at every stage and gradient tier; windows of other lengths match a
single-process reference and DeepSpeed 0.19.8 given the same config."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from helpers.harness import run_on_ranks
from helpers.parity import TINY, Case, build_model, param_groups, relative_difference
from helpers.windows import (
    GAS,
    MICRO,
    WINDOWS,
    batches,
    check_same_as_managed,
    ours,
    reference_windows,
    same_as_managed,
    train_windows,
    window_config,
)

SAME_AS_MANAGED = [
    (Case(stage=0, gas=2, steps=4), {}),
    (Case(stage=1, gas=2, steps=4), {}),
    (Case(stage=1, gas=2, steps=4, reduce_scatter=False), {}),
    (Case(stage=1, gas=2, steps=4), {"zero_optimization": {"overlap_comm": True}}),
    (Case(stage=1, gas=2, steps=2, dtype="bf16"), {}),
    (Case(stage=1, gas=2, steps=4, offload="cpu"), {}),
    (Case(stage=1, gas=2, steps=2), {"torch_autocast": {"enabled": True}}),  # two flat strategies: SplitStrategy
    (Case(stage=2, gas=2, steps=4), {}),
    (Case(stage=2, gas=2, steps=4, offload="cpu"), {}),
    (Case(stage=2, gas=2, steps=3, offload="nvme"), {}),
    (Case(stage=3, gas=2, steps=4), {}),
    (Case(stage=3, gas=2, steps=4, offload="cpu", offload_param="cpu"), {}),
    (Case(stage=3, gas=2, steps=3, offload="nvme"), {}),
    (Case(stage=3, gas=2, steps=4), {"zeroshard": {"backend": "fsdp2"}}),
]


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by caller-owned windows:
# test_windows_of_any_length_match_the_reference_and_deepspeed
@pytest.mark.slow
def test_windows_of_the_configured_length_train_as_the_managed_engine() -> None:
    check_same_as_managed(SAME_AS_MANAGED, run_on_ranks(same_as_managed, 2, SAME_AS_MANAGED, timeout=900))


ONE_STEP_CONFIGS = [Case(stage=2, gas=1, steps=2, dtype="bf16"), Case(stage=3, gas=1, steps=2, dtype="bf16")]


def _one_step_config(rank: int, world_size: int) -> list[Any]:
    out = []
    for case in ONE_STEP_CONFIGS:
        managed = ours(rank, world_size, replace(case, gas=2), {}, True, [2, 2])
        out.append((managed, ours(rank, world_size, case, {}, False, [2, 2], divisor=2)))
    return out


def test_a_window_longer_than_the_configured_one_accumulates_in_the_accumulation_dtype() -> None:
    """gradient_accumulation_steps 1 with windows of 2 (the script halving each loss) trains as gas 2 does: the
    window's gradients accumulate in fp32, not in the bf16 of a one-micro-step window (stage 3 chose the gradient
    dtype by gas alone)."""
    for per_case in run_on_ranks(_one_step_config, 2):
        for case, (managed, unmanaged) in zip(ONE_STEP_CONFIGS, per_case, strict=True):
            assert unmanaged[0] == managed[0] and unmanaged[1].equal(managed[1]), case.name


def _reference(world_size: int, case: Case) -> tuple[list[float], torch.Tensor]:
    """Each loss divided by the configured accumulation steps, whatever the window's length."""
    return reference_windows(world_size, case, WINDOWS, lambda length: GAS)


VARIABLE = [Case(stage=1, gas=GAS), Case(stage=2, gas=GAS), Case(stage=3, gas=GAS)]


def _variable(rank: int, world_size: int) -> list[Any]:
    out = [ours(rank, world_size, case, {}, False, WINDOWS) for case in VARIABLE]
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")
    for case in VARIABLE:
        model = build_model(case)
        config = window_config(case, {}, False)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        out.append(
            train_windows(
                rank, world_size, engine, batches(world_size, WINDOWS), False, deepspeed.zero.GatheredParameters
            )
        )
        engine.destroy()
    return out


def test_windows_of_any_length_match_the_reference_and_deepspeed() -> None:
    results = run_on_ranks(_variable, 2, timeout=900)
    for i, case in enumerate(VARIABLE):
        ref_losses, ref_params = _reference(2, case)
        losses = [sum(results[r][i][0][w] for r in range(2)) / 2 for w in range(len(WINDOWS))]
        assert torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6), (case.name, losses)
        for rank_results in results:
            (_, params, boundaries, counters), deepspeed = rank_results[i], rank_results[len(VARIABLE) + i]
            assert boundaries == deepspeed[2] == [False] * sum(WINDOWS), case.name
            # DeepSpeed counts steps, samples and micro-steps alike
            assert counters == deepspeed[3] == (len(WINDOWS), sum(WINDOWS) * MICRO * 2, len(WINDOWS)), case.name
            assert relative_difference(params, ref_params) < 1e-6, case.name
            assert relative_difference(params, deepspeed[1]) < 1e-6, case.name


def _refusals(rank: int, world_size: int) -> list[str]:
    import zeroshard
    from zeroshard.errors import ZeroshardError

    case = Case(stage=1, gas=GAS)
    engine, *_ = zeroshard.initialize(model=build_model(case), config=window_config(case, {}, False))
    messages = []
    try:
        engine.set_gradient_accumulation_boundary(True)
    except ZeroshardError as error:
        messages.append(str(error))
    engine.destroy()
    return messages


def test_the_boundary_override_is_refused_as_deepspeed_refuses_it() -> None:
    for messages in run_on_ranks(_refusals, 1):
        assert len(messages) == 1 and "managed_gradient_accumulation false" in messages[0], messages


def test_super_offload_needs_managed_windows() -> None:
    from zeroshard.config import parse_config
    from zeroshard.errors import ConfigError

    raw = copy.deepcopy(window_config(Case(stage=3, offload="cpu"), {}, False))
    raw["zero_optimization"]["offload_optimizer"]["super_offload"] = True
    with pytest.raises(ConfigError, match="super_offload: true needs managed_gradient_accumulation true"):
        parse_config(raw)


def _save_or_resume(rank: int, world_size: int, root: str, save: bool) -> tuple[int, int, int, int]:
    import zeroshard

    case = Case(stage=1, gas=GAS)
    engine, *_ = zeroshard.initialize(model=build_model(case), config=window_config(case, {}, False))
    if save:
        for _ in range(2):  # two windows of three micro-batches
            for _ in range(3):
                x = torch.randint(0, TINY.vocab_size, (MICRO, 16))
                engine.backward(engine(x, x))
            engine.step()
        engine.save_checkpoint(root)
    else:
        engine.load_checkpoint(root)
    out = (engine.gradient_accumulation_steps(), engine.global_steps, engine.micro_steps, engine.global_samples)
    engine.destroy()
    return out


def test_a_resume_on_other_replicas_keeps_the_loss_divisor_and_the_counters(tmp_path) -> None:
    """The managed engine keeps a checkpoint's global batch on a new replica count by changing the accumulation
    steps; a script's own windows decide that batch, so the divisor stays as configured (a warning says so) and
    micro-steps keep counting step() calls."""
    saved = run_on_ranks(_save_or_resume, 2, str(tmp_path), True)[0]
    resumed = run_on_ranks(_save_or_resume, 1, str(tmp_path), False)[0]
    assert saved == (GAS, 2, 2, 2 * 3 * MICRO * 2)
    assert resumed == saved
