"""`torch_autocast` ([Note: torch autocast] in zero/flat/autocast.py) on 2 gloo ranks against a single-process
reference whose forward runs under the same `torch.autocast(bf16)` on each rank's micro-batch, fp32 master weights
and AdamW, every step:
- `lower_precision_safe_modules: []` (every gradient reduced in fp32), and stage 3 (which reduces in fp32): 1e-6;
- DeepSpeed's default (the `nn.Linear` gradients reduced in bf16): the reference rounds those gradients as the
  reduction does (each rank's in bf16, summed in bf16, then averaged); the gradients agree exactly but for
  1e-10-sized fp32 differences on LayerNorm weights (as in the fp32 runs), which Adam's normalisation turns into
  up to 2e-5 relative parameter differences by the fourth step, so 1e-4; and the reduce-scatter sends 2 bytes per
  Linear parameter instead of 4 (stage 0's all-reduce likewise).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, flat_params, global_batches, micro_batch, param_groups

TOL = 1e-6
LOW_TOL = 1e-4  # bf16 reduction: see the module docstring


def _config(case: Case, safe: list[str] | None) -> dict:
    block: dict = {"enabled": True, "dtype": "bf16"}
    if safe is not None:
        block["lower_precision_safe_modules"] = safe
    return {**ds_config(case), "torch_autocast": block}


def _train(rank: int, world_size: int, case: Case, safe: list[str] | None):
    import torch.distributed as dist

    import zeroshard

    model = build_model(case)
    config = _config(case, safe)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    losses, params, sent = [], [], []
    for batch in global_batches(case, world_size):
        before = engine.comm_stats.snapshot()
        x, y = micro_batch(batch, 0, rank, world_size, case.micro)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        after = engine.comm_stats.snapshot()
        sent.append({k: after[k]["bus_bytes"] - before[k]["bus_bytes"] for k in after})
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
        with engine.gathered_for_generation():
            params.append(flat_params(engine.module))
    engine.destroy()
    return losses, params, sent


def _reference(case: Case, world_size: int, low_precision: bool):
    """Per-rank forward and backward under autocast; gradients reduced as the engine's reduction rounds them."""
    model = build_model(case)
    optimizer = torch.optim.AdamW(param_groups(model, case), lr=case.lr)
    linear = {id(p) for m in model.modules() if type(m) is nn.Linear for p in m.parameters(recurse=False)}
    losses, params = [], []
    for batch in global_batches(case, world_size):
        per_rank, step_losses = [], []
        for r in range(world_size):
            x, y = micro_batch(batch, 0, r, world_size, case.micro)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            step_losses.append(float(loss.detach()))
            per_rank.append({id(p): p.grad.clone() for p in model.parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
        for p in model.parameters():
            grads = [g[id(p)] for g in per_rank if id(p) in g]
            if low_precision and id(p) in linear:
                total = grads[0].bfloat16()
                for g in grads[1:]:
                    total = total + g.bfloat16()
                p.grad = total.float() / world_size
            else:
                p.grad = sum(grads) / world_size if grads else torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(sum(step_losses) / world_size)
        params.append(flat_params(model))
    return losses, params


def _check(case: Case, result, reference, tol: float = TOL) -> None:
    (losses, params, _), (ref_losses, ref_params) = result, reference
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= tol * abs(b), (case.name, step, a, b)
    for step, (p, q) in enumerate(zip(params, ref_params, strict=True)):
        rel = float((p - q).abs().max() / q.abs().max())
        assert rel <= tol, (case.name, step, rel)


@pytest.mark.parametrize("stage", [0, pytest.param(1, marks=pytest.mark.slow), 2])
def test_linear_gradients_reduced_in_bf16_match_the_rounded_reference(stage: int) -> None:
    case = Case(stage=stage, steps=4)
    low = run_on_ranks(_train, 2, case, None)[0]
    _check(case, low, _reference(case, 2, low_precision=True), LOW_TOL)
    fp32 = run_on_ranks(_train, 2, case, [])[0]
    _check(case, fp32, _reference(case, 2, low_precision=False))
    kind = "all_reduce" if stage == 0 else "reduce_scatter"
    low_bytes, fp32_bytes = low[2][-1][kind], fp32[2][-1][kind]
    assert 0.5 * fp32_bytes < low_bytes < 0.75 * fp32_bytes, (low_bytes, fp32_bytes)  # Linear: most of TINY


def test_stage3_reduces_in_fp32() -> None:
    case = Case(stage=3, steps=4)
    _check(case, run_on_ranks(_train, 2, case, None)[0], _reference(case, 2, low_precision=False))


def test_fp16_and_a_second_precision_mode_are_refused() -> None:
    from zeroshard.config import parse_config
    from zeroshard.errors import ConfigError

    base = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match="gradient scaler"):
        parse_config({**base, "torch_autocast": {"enabled": True, "dtype": "fp16"}})
    with pytest.raises(ConfigError, match="two precision modes"):
        parse_config({**base, "bf16": {"enabled": True}, "torch_autocast": {"enabled": True}})


def _save_and_load(rank: int, world_size: int, case: Case, path: str) -> list[bool]:
    import zeroshard
    from zeroshard.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    def engine(config: dict):
        model = build_model(case)
        return zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)[0]

    saved = engine(_config(case, None))
    for batch in global_batches(case, world_size)[:2]:
        saved.backward(saved(*micro_batch(batch, 0, rank, world_size, case.micro)))
        saved.step()
    saved.save_checkpoint(path)
    plain = ds_config(case) | {"zero_optimization": {**ds_config(case)["zero_optimization"], "stage": 1}}
    same = []
    for config in (_config(case, None), plain):  # into the split again, and into an engine without torch_autocast
        loaded = engine(config)
        loaded.load_checkpoint(path)
        for a, b in zip(saved.module.parameters(), loaded.module.parameters(), strict=True):
            same.append(torch.equal(safe_get_full_fp32_param(a), safe_get_full_fp32_param(b)))
            same.append(torch.equal(*(safe_get_full_optimizer_state(p, "exp_avg") for p in (a, b))))
        loaded.destroy()
    return same


def test_checkpoints_of_the_split_load_into_it_and_into_a_plain_engine(tmp_path) -> None:
    """The two parts' master weights and optimizer state are saved under the parameters' own names."""
    results = run_on_ranks(_save_and_load, 2, Case(stage=2, steps=2), str(tmp_path))
    assert all(all(r) and r for r in results), results
