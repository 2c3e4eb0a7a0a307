"""`torch_autocast` ([Note: torch autocast] in zero/flat/autocast.py) on 2 gloo ranks against a single-process
reference whose forward runs under the same `torch.autocast(bf16)` on each rank's micro-batch, fp32 master weights
and AdamW, every step:
- `lower_precision_safe_modules: []` (every gradient reduced in fp32), stage 0 (DeepSpeed's engine reduces in
  `communication_data_type` there, fp32) and stage 3 (which reduces in fp32): 1e-6;
- DeepSpeed's default (the `nn.Linear` gradients reduced in bf16): the reference rounds those gradients as the
  reduction does (each rank's in bf16, summed in bf16, then averaged); the gradients agree exactly but for
  1e-10-sized fp32 differences on LayerNorm weights (as in the fp32 runs), which Adam's normalisation turns into
  up to 2e-5 relative parameter differences by the fourth step, so 1e-4; and the reduce-scatter sends 2 bytes per
  Linear parameter instead of 4.
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


@pytest.mark.parametrize("stage", [1, 2])
def test_linear_gradients_reduced_in_bf16_match_the_rounded_reference(stage: int) -> None:
    case = Case(stage=stage, steps=4)
    low = run_on_ranks(_train, 2, case, None)[0]
    _check(case, low, _reference(case, 2, low_precision=True), LOW_TOL)
    fp32 = run_on_ranks(_train, 2, case, [])[0]
    _check(case, fp32, _reference(case, 2, low_precision=False))
    low_bytes, fp32_bytes = low[2][-1]["reduce_scatter"], fp32[2][-1]["reduce_scatter"]
    assert 0.5 * fp32_bytes < low_bytes < 0.75 * fp32_bytes, (low_bytes, fp32_bytes)  # Linear: most of TINY


@pytest.mark.parametrize("stage", [0, 3])
def test_stages_0_and_3_reduce_in_fp32(stage: int) -> None:
    case = Case(stage=stage, steps=4)
    _check(case, run_on_ranks(_train, 2, case, None)[0], _reference(case, 2, low_precision=False))


def test_fp16_and_a_second_precision_mode_are_refused() -> None:
    from zeroshard.config import parse_config
    from zeroshard.errors import ConfigError

    base = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match="gradient scaler"):
        parse_config({**base, "torch_autocast": {"enabled": True, "dtype": "fp16"}})
    with pytest.raises(ConfigError, match="two precision modes"):
        parse_config({**base, "fp16": {"enabled": True}, "torch_autocast": {"enabled": True}})
    with pytest.raises(ConfigError, match='torch_autocast.dtype "fp32" with bf16.enabled'):
        parse_config({**base, "bf16": {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": "fp32"}})
    muon = {**base, "optimizer": {"type": "Muon", "params": {"lr": 0.01}}, "torch_autocast": {"enabled": True}}
    with pytest.raises(ConfigError, match="Muon.*torch_autocast"):
        parse_config(muon)
    parse_config({**muon, "bf16": {"enabled": True}})  # beside bf16 autocast only wraps the forward: Muon's math holds


class MseNet(nn.Module):
    """A Linear and its MSE loss, which CPU autocast runs in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.lin(x), torch.ones_like(x))


def _bf16_under_autocast(rank: int, world_size: int) -> list[tuple[torch.dtype, float, float]]:
    import copy

    import zeroshard

    out = []
    for autocast in (True, False):
        torch.manual_seed(0)
        model = MseNet()
        reference = copy.deepcopy(model).to(torch.bfloat16)
        config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
        config |= {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        if autocast:
            config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
        engine = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
        x = torch.randn(2, 8)
        got = engine(x.to(torch.bfloat16))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            want = reference(x.to(torch.bfloat16))
        out.append((got.dtype, float(got.float().sum()), float(want.float().sum())))
        engine.destroy()
    return out


def test_bf16_with_torch_autocast_runs_the_bf16_models_forward_under_autocast() -> None:
    """DeepSpeed's bf16_master_weight example's headline config (bf16 and torch_autocast) was refused: the bf16 model's
    forward runs under autocast (mse_loss in fp32, as CPU autocast's policy says), the rest is bf16 training."""
    (with_autocast, without) = run_on_ranks(_bf16_under_autocast, 1)[0]
    assert with_autocast[0] == torch.float32 and with_autocast[1] == with_autocast[2], with_autocast
    assert without[0] == torch.bfloat16 and without[1] == without[2], without


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


def _outer_autocast(rank: int, world_size: int) -> list[torch.dtype]:
    import zeroshard

    seen: list[torch.dtype] = []
    model = nn.Linear(4, 4)
    model.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine(torch.randn(2, 4))  # without torch_autocast the caller's autocast is off inside, as in DeepSpeed
    engine.destroy()
    config["torch_autocast"] = {"enabled": True, "dtype": "bf16"}
    engine = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)[0]
    engine(torch.randn(2, 4))
    engine.destroy()
    return seen


def test_a_callers_autocast_is_replaced_by_the_engines_precision() -> None:
    assert run_on_ranks(_outer_autocast, 1)[0] == [torch.float32, torch.bfloat16]


def _client_groups(rank: int, world_size: int) -> list[tuple[float, float]]:
    import zeroshard

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    groups = [
        {"params": list(model[1].parameters()), "weight_decay": 0.0},
        {"params": list(model[0].parameters()), "weight_decay": 0.1},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    config["torch_autocast"] = {"enabled": True, "dtype": "bf16"}
    engine = zeroshard.initialize(model=model, optimizer=optimizer, config=config)[0]
    strategy = engine.strategy
    out = []
    for part, expected in ((strategy.low, 0.1), (strategy.rest, 0.0)):
        masters = {id(p) for g in part.master_param_groups() for p in g["params"]}
        for group in engine.optimizer.param_groups:
            if any(id(p) in masters for p in group["params"]):
                out.append((group["weight_decay"], expected))
    engine.destroy()
    return out


def test_a_client_optimizers_group_options_follow_their_parameters_into_the_parts() -> None:
    """The split lists the Linear part's groups first: pairing them with the client's groups by position would
    give the Linear weights the LayerNorm group's weight decay."""
    pairs = run_on_ranks(_client_groups, 1)[0]
    assert len(pairs) == 2 and all(got == want for got, want in pairs), pairs
