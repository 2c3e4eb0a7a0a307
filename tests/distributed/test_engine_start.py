"""Engine construction ends in step on every rank ([Note: one-rank checkpoint calls] in checkpoint/watch.py)."""

from __future__ import annotations

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


def _half_module_without_precision(rank: int, world_size: int) -> list[tuple[bool, bool, bool]]:
    import logging

    import zeroshard

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zeroshard").addHandler(handler)
    out = []
    for dtype, block in ((torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, "bf16")):
        seen.clear()
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(dtype)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            **({block: {"enabled": True}} if block else {}),
        }
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
        warned = any("enables neither bf16 nor fp16: the module is cast to fp32" in m for m in seen)
        kept = next(engine.module.parameters()).dtype == dtype
        out.append((warned, kept, engine.bfloat16_enabled()))
        engine.destroy()
    logging.getLogger("zeroshard").removeHandler(handler)
    return out


def test_a_module_in_bf16_or_fp16_without_a_precision_block_is_named_before_it_is_cast() -> None:
    """DeepSpeed trains such a module in its own dtype; zeroshard casts it to fp32, and says so in one warning naming
    the key to set (rank 0), before any work. With the bf16 block: no warning, the module stays bf16."""
    on_rank_0, on_rank_1 = run_on_ranks(_half_module_without_precision, 2)
    assert on_rank_0 == [(True, False, False), (True, False, False), (False, True, True)], on_rank_0
    assert [warned for warned, *_ in on_rank_1] == [False, False, False], on_rank_1


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
