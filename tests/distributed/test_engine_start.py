"""Engine construction ends in step on every rank ([Note: one-rank checkpoint calls] in checkpoint/watch.py)."""

from __future__ import annotations

import math
import time

import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, param_groups


def _late_connection(rank: int, world_size: int) -> bool:
    """Rank 1 opens its watch connection to the store two seconds late; rank 0 returns as soon as `initialize`
    does (and the harness then tears its process group, which serves the store, down)."""
    import zeroshard
    from zeroshard.checkpoint import watch

    if rank == 1:
        real = watch.default_store

        class Late:
            def __init__(self, store):
                self.store = store

            def clone(self):
                time.sleep(2.0)
                return self.store.clone()

        watch.default_store = lambda: Late(real())  # type: ignore[assignment]
    case = Case(stage=1, steps=1)
    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    started = engine._watch is not None
    engine.destroy()
    return started


def test_no_rank_leaves_initialize_before_its_peers_have_connected():
    """Before, rank 1 retried the address of rank 0's finished store for 300 s (and again): the test timed out. The
    fsdp2 dtype test hit it twice under load (600 s, then a timeout) when rank 1 started late."""
    assert run_on_ranks(_late_connection, 2, timeout=60) == [True, True]


def _in_the_module_dtype(rank: int, world_size: int) -> dict:
    import contextlib

    import zeroshard

    out = {}
    for dtype, block in ((torch.bfloat16, None), (torch.bfloat16, "bf16"), (torch.float16, None)):
        for stage in (0, 3):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(dtype)
            config = {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "zero_optimization": {"stage": stage},
                **({block: {"enabled": True}} if block else {}),
            }
            engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
            generator, losses = torch.Generator().manual_seed(rank), []
            for _ in range(3):  # inputs in the module's dtype: the forward failed when the module was cast to fp32
                loss = engine(torch.randn(2, 8, generator=generator).to(dtype)).float().pow(2).mean()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            with engine.gathered_for_generation() if stage == 3 else contextlib.nullcontext():
                kept = next(engine.module.parameters()).dtype == dtype
            out[(str(dtype), block, stage)] = (losses, kept, engine.bfloat16_enabled(), engine.fp16_enabled())
            engine.destroy()
    return out


def test_a_module_in_bf16_or_fp16_without_a_precision_block_trains_in_its_dtype() -> None:
    """As DeepSpeed, which casts nothing without fp16/bf16 in the config: a bf16 module trains in bf16 (as with the
    bf16 block, loss for loss), an fp16 one in fp16 (with the fp16 block's loss scaler); zeroshard cast both to fp32."""
    for out in run_on_ranks(_in_the_module_dtype, 2):
        for stage in (0, 3):
            unset, named = out[("torch.bfloat16", None, stage)], out[("torch.bfloat16", "bf16", stage)]
            assert unset == named and unset[1:] == (True, True, False), (stage, unset, named)
            half = out[("torch.float16", None, stage)]
            assert half[1:] == (True, False, True) and all(math.isfinite(x) for x in half[0]), (stage, half)


def _backward_returns(rank: int, world_size: int) -> list[float]:
    import zeroshard

    model = torch.nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD"}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.ones(1, 4)).sum()
    returned = [engine.backward(loss, retain_graph=True).item(), engine.backward(loss, scale_wrt_gas=False).item()]
    engine.destroy()
    return [loss.item(), *returned]


def test_backward_returns_the_loss_divided_by_the_accumulation_steps() -> None:
    """As DeepSpeed's: the loss it back-propagates (loss / gradient_accumulation_steps; the loss as given with
    scale_wrt_gas=False), without the fp16 loss scale (DeepSpeed's multi-output tests compare it)."""
    for loss, scaled, unscaled in run_on_ranks(_backward_returns, 2):
        assert (scaled, unscaled) == (loss / 2, loss), (loss, scaled, unscaled)
