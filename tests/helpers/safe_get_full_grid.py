"""`zeroshard.utils.safe_get_full_fp32_param` / `safe_get_full_grad` / `safe_get_full_optimizer_state` on 2 gloo
ranks at stages 0-3, each step against a single-process torch reference. `run_grid` runs on every rank inside the
spawn of tests/distributed/test_compat_engine.py; `check_grid` compares what the ranks returned."""

from __future__ import annotations

import torch
from torch import nn

STAGES = (0, 1, 2, 3)
STEPS = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    # odd sizes, and buckets of 16 elements: parameters straddle buckets and shard boundaries
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 + step))


def _config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 16, "allgather_bucket_size": 16}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05, "weight_decay": 0.1}},
        "zero_optimization": zero,
    }


def _new_values(params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the test sets after STEPS steps: the first weight, and the last bias's exp_avg."""
    first, last = params[0], params[-1]
    return torch.linspace(-1, 1, first.numel()).view(first.shape), torch.full(last.shape, 0.25)


def _reference() -> list[dict[str, list[torch.Tensor]]]:
    """Per step: the full gradient before the step, then parameters and Adam moments after it. After STEPS steps
    the values of `_new_values` are set, then one more step is taken."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, foreach=False)
    seen = []
    for step in range(STEPS + 1):
        if step == STEPS:
            params = list(model.parameters())
            weight, exp_avg = _new_values(params)
            with torch.no_grad():
                params[0].copy_(weight)
            opt.state[params[-1]]["exp_avg"].copy_(exp_avg)
        model(_batch(step)).pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        seen.append(
            {
                "grad": grads,
                "param": [p.detach().clone() for p in model.parameters()],
                "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()],
                "exp_avg_sq": [opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()],
            }
        )
    return seen


def run_grid(rank: int, world_size: int) -> dict:
    import zeroshard
    from zeroshard.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    out: dict = {}
    for stage in STAGES:
        model = _model()
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config(stage))
        params = list(model.parameters())
        before = {
            "param": [safe_get_full_fp32_param(p) for p in params],
            "exp_avg": [safe_get_full_optimizer_state(p, "exp_avg") for p in params],
        }
        if stage == 3:  # before the first step: None on every rank, whatever part it holds
            before["local_exp_avg"] = [safe_get_local_optimizer_state(p, "exp_avg") for p in params]
        steps = []
        for step in range(STEPS + 1):
            if step == STEPS:
                weight, exp_avg = _new_values(list(_model().parameters()))  # stage 3 parameters hold no shape
                safe_set_full_fp32_param(params[0], weight)
                safe_set_full_optimizer_state(params[-1], exp_avg, "exp_avg")
                was_set = (safe_get_full_fp32_param(params[0]), safe_get_full_optimizer_state(params[-1], "exp_avg"))
            x = _batch(step)[2 * rank : 2 * rank + 2]
            engine.backward(engine(x).pow(2).mean())
            grads = [safe_get_full_grad(p) for p in params]
            if stage == 3:  # [Note: local values]: this rank's parts, no collective
                local_grads = [safe_get_local_grad(p) for p in params]
            engine.step()
            steps.append(
                {
                    "grad": grads,
                    "param": [safe_get_full_fp32_param(p) for p in params],
                    "exp_avg": [safe_get_full_optimizer_state(p, "exp_avg") for p in params],
                    "exp_avg_sq": [safe_get_full_optimizer_state(p, "exp_avg_sq") for p in params],
                }
            )
        local: dict = {}
        if stage == 3:
            local = {
                "grad": local_grads,
                "param": [safe_get_local_fp32_param(p) for p in params],
                "exp_avg": [safe_get_local_optimizer_state(p, "exp_avg") for p in params],
            }
            mine = local["param"][0]
            safe_set_local_fp32_param(params[0], torch.full_like(mine, rank + 1.0))
            safe_set_local_optimizer_state(params[-1], torch.full_like(local["exp_avg"][-1], -rank - 1.0), "exp_avg")
            local["set"] = (safe_get_full_fp32_param(params[0]), safe_get_full_optimizer_state(params[-1], "exp_avg"))
            local["sizes"] = (mine.numel(), local["exp_avg"][-1].numel())
            try:  # Adam's scalar step count has no parts
                safe_get_local_optimizer_state(params[0], "step")
            except zeroshard.ZeroshardError as e:
                local["scalar"] = str(e)
        else:
            try:
                safe_get_local_fp32_param(params[0])
            except zeroshard.ZeroshardError as e:
                local["refused"] = str(e)
        stranger = nn.Parameter(torch.ones(2))
        out[stage] = {
            "local": local,
            "was_set": was_set,
            "before": before,
            "steps": steps,
            "stranger": (safe_get_full_fp32_param(stranger), safe_get_full_optimizer_state(stranger, "exp_avg")),
        }
        engine.destroy()
        assert safe_get_full_fp32_param(params[0]) is None  # destroy unregisters
    return out


def check_grid(results: list[dict]) -> None:
    reference = _reference()
    init = [p.detach().clone() for p in _model().parameters()]
    for rank, result in enumerate(results):
        for stage in STAGES:
            got = result[stage]
            where = f"rank {rank} stage {stage}"
            for mine, want in zip(got["before"]["param"], init, strict=True):
                torch.testing.assert_close(mine, want, rtol=0, atol=0, msg=where)
            assert got["before"]["exp_avg"] == [None] * len(init), where  # no state before the first step
            for mine, want in zip(got["was_set"], _new_values(init), strict=True):
                torch.testing.assert_close(mine, want, rtol=0, atol=0, msg=f"{where} safe_set_full_*")
            for step, (mine, want) in enumerate(zip(got["steps"], reference, strict=True)):
                for key, tensors in want.items():
                    for i, (a, b) in enumerate(zip(mine[key], tensors, strict=True)):
                        assert a is not None and a.dtype == torch.float32 and a.shape == b.shape, (where, key)
                        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{where} step {step} {key}[{i}]")
            assert got["stranger"] == (None, None), where
            if stage < 3:
                assert "defined for ZeRO-3 partitioned parameters only" in got["local"]["refused"], where
    # stage 3: the ranks' parts, in rank order, are the whole values; the setters wrote each rank's part
    for result in results:
        assert result[3]["before"]["local_exp_avg"] == [None] * len(init)
        assert "'step' is a scalar" in result[3]["local"]["scalar"], result[3]["local"]["scalar"]
    last = [result[3]["steps"][-1] for result in results]
    for key in ("grad", "param", "exp_avg"):
        for i, whole in enumerate(last[0][key]):
            parts = torch.cat([result[3]["local"][key][i] for result in results])
            torch.testing.assert_close(parts, whole.reshape(-1), rtol=0, atol=0, msg=f"stage 3 local {key}[{i}]")
    for index, fill in ((0, 1.0), (1, -1.0)):  # the first weight's master, the last bias's exp_avg
        sizes = [result[3]["local"]["sizes"][index] for result in results]
        want = torch.cat([torch.full((n,), fill * (r + 1)) for r, n in enumerate(sizes)])
        for result in results:
            torch.testing.assert_close(result[3]["local"]["set"][index].reshape(-1), want, rtol=0, atol=0)
