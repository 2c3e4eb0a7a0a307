"""Engine construction ends in step on every rank ([Note: one-rank checkpoint calls] in checkpoint/watch.py)."""

from __future__ import annotations

import time

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
