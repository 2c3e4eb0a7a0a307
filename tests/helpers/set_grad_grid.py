"""`safe_set_full_grad`, `safe_update_full_grad_vectorized` and `safe_set_local_grad` ([Note: setting a gradient])
on 2 gloo ranks (or CUDA ranks: tests/gpu), every stage and gradient tier, against a single-process reference that
edits `p.grad` the same way before clipping and AdamW. `run_grid` runs on every rank; `reference_params` is the
reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from helpers.parity import Case, build_model, ds_config, flat_params, global_batches, micro_batch, param_groups

CLIP = 0.5  # the surgery raises the norm: clipping acts, so it must see the new gradients

# (name, Case, extra config): every place a reduced gradient waits for the step
CASES: list[tuple[str, Case, dict[str, Any]]] = [
    ("stage0", Case(stage=0, gas=2, steps=3, clip=CLIP), {}),
    ("stage1", Case(stage=1, gas=2, steps=3, clip=CLIP), {}),
    ("stage1-gas1", Case(stage=1, gas=1, steps=3, clip=CLIP), {}),  # no accumulator ([Note: stage 1's ... demand])
    ("stage2-cpu", Case(stage=2, gas=2, steps=3, clip=CLIP, offload="cpu"), {}),  # (host copies: COPY_CASES)
    ("stage3", Case(stage=3, gas=2, steps=3, clip=CLIP), {}),
    ("stage3-cpu", Case(stage=3, gas=2, steps=3, clip=CLIP, offload="cpu"), {}),
    ("stage3-partial", Case(stage=3, gas=1, steps=3, clip=CLIP, offload="cpu", ratio=0.5), {}),
    ("stage3-nvme", Case(stage=3, gas=2, steps=3, clip=CLIP, offload="nvme"), {}),  # shards in swap files
    ("fsdp2", Case(stage=3, gas=2, steps=3, clip=CLIP), {"zeroshard": {"backend": "fsdp2"}}),
]
# On the CPU a host copy exists only where the dtype changes ([Note: gradients to the host during backward]): bf16
# gradient shards (stage 3 releases them into the fp32 copies). These runs match the same run without offload bit for
# bit, the values set rounded to bf16 alike on both.
BF16_GRADS = {"data_types": {"grad_accum_dtype": "bf16"}}
COPY_CASES: list[tuple[str, Case]] = [
    ("stage2", Case(stage=2, dtype="bf16", gas=2, steps=2, clip=CLIP, offload="cpu")),
    ("stage3", Case(stage=3, dtype="bf16", gas=2, steps=2, clip=CLIP, offload="cpu")),
]
# bf16 checks inf/nan by default: a NaN set after the boundary skips the step wherever the shard waits
OVERFLOW_CASES: list[tuple[str, Case]] = [
    ("stage2-cpu", Case(stage=2, dtype="bf16", gas=2, steps=1, offload="cpu")),
    ("stage3-cpu", Case(stage=3, dtype="bf16", gas=2, steps=1, offload="cpu")),  # the shard released to its copy
    ("stage3-nvme", Case(stage=3, dtype="bf16", gas=2, steps=1, offload="nvme")),  # the shard in its swap file
]


def surgery(index: int, step: int, grad: torch.Tensor) -> torch.Tensor | None:
    """The new gradient of the `index`-th parameter (None: left alone): half its elements masked, doubled (negated
    every other step) and shifted by an amount bf16 cannot hold, or halved (stage 3 does the last through the local
    API)."""
    if index % 4 == 0:
        out = grad.clone()
        out.view(-1)[: out.numel() // 2] = 0
        return out
    if index % 4 == 1:
        return grad * (-2 if step % 2 else 2) + 1e-3 / 3
    if index % 4 == 2:
        return grad * 0.5
    return None


def reference_params(case: Case, world: int = 2) -> list[torch.Tensor]:
    """Plain PyTorch on the whole global batch; `surgery` on `p.grad` before clipping and AdamW."""
    model = build_model(case)
    optimizer = torch.optim.AdamW(param_groups(model, case), lr=case.lr)
    trainable = [p for p in model.parameters() if p.requires_grad]
    out = []
    for step, batch in enumerate(global_batches(case, world)):
        model.flip = step % 2 == 1
        model.zero_grad()
        for k in range(case.gas):
            for r in range(world):
                x, y = micro_batch(batch, k, r, world, case.micro)
                (model(x, y) / (world * case.gas)).backward()
        with torch.no_grad():
            for i, p in enumerate(trainable):
                new = surgery(i, step, p.grad)
                if new is not None:
                    p.grad.copy_(new)
        torch.nn.utils.clip_grad_norm_(trainable, case.clip)
        optimizer.step()
        out.append(flat_params(model))
    return out


def _edit(engine: Any, step: int, local: bool, held: torch.dtype = torch.float32) -> float:
    """The boundary's surgery through DeepSpeed's calls; the largest difference between a value set, as gradients of
    dtype `held` hold it, and what `safe_get_full_grad` then reads (0: exact)."""
    from zeroshard.utils import (
        safe_get_full_grad,
        safe_get_local_grad,
        safe_set_full_grad,
        safe_set_local_grad,
        safe_update_full_grad_vectorized,
    )

    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(trainable)}
    written: dict[int, torch.Tensor] = {}

    def update(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        new = surgery(index[id(param)], step, grad)
        written[index[id(param)]] = new
        return new

    safe_update_full_grad_vectorized([p for i, p in enumerate(trainable) if i % 4 == 1], update)
    for i, p in enumerate(trainable):
        if i % 4 == 0:
            written[i] = surgery(i, step, safe_get_full_grad(p))
            safe_set_full_grad(p, written[i])
        elif i % 4 == 2 and local:  # [Note: local values]: this rank's part, no collective
            safe_set_local_grad(p, safe_get_local_grad(p) * 0.5)
        elif i % 4 == 2:
            safe_set_full_grad(p, surgery(i, step, safe_get_full_grad(p)))
    back = [(safe_get_full_grad(trainable[i]), value.to(held).float()) for i, value in written.items()]
    return max(float((got - value).abs().max()) for got, value in back)


def _train(
    rank: int, world: int, case: Case, extra: dict[str, Any], edit: Callable[[Any, int], Any]
) -> tuple[list, list, int]:
    """Per step: the flat parameters, and what `edit` returned with whether the step was applied; the host copies
    made in backward."""
    import zeroshard
    from zeroshard.utils import safe_get_full_grad

    model = build_model(case)
    config = {**ds_config(case), **extra}
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    params, seen = [], []
    for step, batch in enumerate(global_batches(case, world)):
        engine.module.flip = step % 2 == 1
        if step > 0:  # between windows a gradient reads as zero (None on fsdp2), and reading it changes nothing
            between = safe_get_full_grad(next(engine.module.parameters()))
            assert between is None or not between.any(), (step, between.abs().max())
        for k in range(case.gas):
            x, y = (t.to(engine.device) for t in micro_batch(batch, k, rank, world, case.micro))
            engine.backward(engine(x, y))
            if k == case.gas - 1:
                seen.append(edit(engine, step))
                resident = _swapped_in(engine)
            engine.step()
        seen[-1] = (seen[-1], engine.was_step_applied(), resident)
        with engine.gathered_for_generation():
            params.append(flat_params(engine.module))
    copies = getattr(engine.strategy, "host_copies_in_backward", 0)  # the fsdp2 backend has none
    engine.destroy()
    return params, seen, copies


def run_grid(rank: int, world_size: int) -> dict[str, Any]:
    from zeroshard.utils import safe_set_full_grad

    out: dict[str, Any] = {}
    for name, case, extra in CASES:
        local = case.stage == 3 and not extra
        out[name] = _train(rank, world_size, case, extra, lambda engine, step, local=local: _edit(engine, step, local))
    for name, case in COPY_CASES:
        local = case.stage == 3
        for offload in ("cpu", "none"):
            twin = replace(case, offload=offload)
            edit = lambda e, s, k=local: _edit(e, s, k, torch.bfloat16)  # noqa: E731
            out[f"copies-{name}-{offload}"] = _train(rank, world_size, twin, BF16_GRADS, edit)

    def poison(engine: Any, step: int) -> bool:
        """NaN into wte.weight's gradient; whether stage 3 had released its shard into the host copy."""
        weight = next(engine.module.parameters())
        released = engine.zero_optimization_stage() == 3 and engine.strategy._slot_of(weight)[0].grad_in_copy
        safe_set_full_grad(weight, torch.full((64, 32), float("nan")))
        return released

    for name, case in OVERFLOW_CASES:
        before = flat_params(build_model(case).to(torch.bfloat16))  # (flat_params: on the host)
        params, seen, _ = _train(rank, world_size, case, BF16_GRADS, poison)
        out[f"overflow-{name}"] = (bool(torch.equal(params[-1], before)), *seen[-1][:2])
    out["refused"] = _refusals(rank, world_size)
    return out


def _swapped_in(engine: Any) -> int:
    """Stage-3 gradient shards kept in swap files that are in memory now (the gets and sets read them in and let
    them go again: 0)."""
    if engine.zero_optimization_stage() != 3 or not engine.strategy.gradients_tier.holds_shards:
        return 0
    return sum(u.grad_home.is_resident(u.grad_key) and not u.grad_zero for u in engine.strategy.units if u.trainable)


def _refusals(rank: int, world: int) -> list[Any]:
    """Where no reduced gradient exists yet, and values of the wrong length: one line each; mid-window at stages
    0-1, `safe_get_full_grad` against this rank's own gradient of its micro-batch (DeepSpeed's `p.grad` then)."""
    import zeroshard
    from zeroshard.utils import safe_get_full_grad, safe_get_local_grad, safe_set_full_grad, safe_set_local_grad

    out: list[Any] = []
    for stage, gas, managed in ((0, 2, True), (1, 2, True), (0, 1, False)):
        case = Case(stage=stage, gas=gas, steps=1)
        model = build_model(case)
        config = {**ds_config(case), "managed_gradient_accumulation": managed}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        x, y = (t.to(engine.device) for t in micro_batch(global_batches(case, world)[0], 0, rank, world, case.micro))
        engine.backward(engine(x, y))  # mid-window (gas 2), or before step() reduces a caller-owned window
        alone = build_model(case).to(engine.device)
        (alone(x, y) / gas).backward()
        mine = [safe_get_full_grad(p) for p in engine.module.parameters()]
        out.append(max(float((a - p.grad).abs().max()) for a, p in zip(mine, alone.parameters(), strict=True)))
        try:
            safe_set_full_grad(next(model.parameters()), torch.zeros(64, 32))
        except zeroshard.ZeroshardError as e:
            out.append(str(e))
        engine.destroy()
    case = Case(stage=3, steps=1)
    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    x, y = (t.to(engine.device) for t in micro_batch(global_batches(case, world)[0], 0, rank, world, case.micro))
    engine.backward(engine(x, y))
    weight = next(model.parameters())
    for call, value in (
        (safe_set_full_grad, torch.zeros(63, 32)),
        (safe_set_local_grad, torch.zeros(safe_get_local_grad(weight).numel() + 1)),
    ):
        try:
            call(weight, value)
        except zeroshard.ZeroshardError as e:
            out.append(str(e))
    engine.destroy()
    return out
