"""An engine dropped without `destroy()` is freed with everything it held ([Note: tensor hooks hold their owner
weakly] in zero/owners.py): before, every stage's gradient hooks held the strategy from torch's C++ side, where the
garbage collector cannot follow them, and a script that built a second engine kept the first one's model, shards,
master weights and optimizer state."""

from __future__ import annotations

import gc
import weakref

from helpers.harness import run_on_ranks
from helpers.parity import Case

_KINDS = (  # (stage, offload, extra config)
    (0, "none", {}),
    (1, "none", {}),
    (2, "cpu", {}),
    (3, "none", {}),
    (3, "cpu", {"gradient_clipping": 0.0, "super_offload": True}),
    (3, "none", {"zeroshard": {"backend": "fsdp2"}}),
)


def _dropped(rank: int, world_size: int):
    import zeroshard
    from helpers.parity import build_model, ds_config, global_batches, micro_batch, param_groups

    out = []
    for stage, offload, extra in _KINDS:
        case = Case(stage=stage, offload=offload, steps=2, persistence=100)
        config = ds_config(case)
        if extra.get("super_offload"):
            config["gradient_clipping"] = extra["gradient_clipping"]
            config["zero_optimization"]["offload_optimizer"]["super_offload"] = True
        if "zeroshard" in extra:
            config["zeroshard"] = extra["zeroshard"]
        model = build_model(case)
        results = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        engine = results[0]
        del results
        for batch in global_batches(case, world_size):
            x, y = micro_batch(batch, 0, rank, world_size, case.micro)
            engine.backward(engine(x, y))
            engine.step()
        held = [weakref.ref(x) for x in (engine, engine.strategy, engine.optimizer, engine.basic_optimizer, model)]
        del engine, model
        gc.collect()
        out.append([ref() is None for ref in held])
    return out


def test_an_engine_dropped_without_destroy_is_freed():
    """Every stage (and super_offload's worker thread, and the fsdp2 backend), after training steps: engine,
    strategy, optimizer (the torch one and engine.optimizer's view of it) and model are collected once the script
    lets go of them."""
    for per_rank in run_on_ranks(_dropped, 2):
        for kind, freed in zip(_KINDS, per_rank, strict=True):
            assert freed == [True] * 5, (kind, freed)


def _model_kept(rank: int, world_size: int):
    import zeroshard
    from helpers.parity import build_model, ds_config, param_groups

    case = Case(stage=2)
    model = build_model(case)
    engine = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))[0]
    hooked = sum(bool(p._post_accumulate_grad_hooks) for p in model.parameters())
    del engine
    gc.collect()
    return hooked, sum(bool(p._post_accumulate_grad_hooks) for p in model.parameters())


def test_a_model_that_outlives_its_engine_keeps_no_dead_hooks():
    """Stages 0-2: the strategy's gradient hooks leave the parameters with it (built again on the same model, an
    engine would otherwise find the dead ones still there)."""
    for hooked, left in run_on_ranks(_model_kept, 2):
        assert hooked > 0 and left == 0
