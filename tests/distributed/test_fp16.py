"""fp16: an inf on one rank's gradient skips the step on every rank and leaves parameters unchanged."""

from __future__ import annotations

import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups


def _overflow(rank: int, world_size: int, stage: int, offload: str = "none"):
    import zeroshard

    case = Case(stage=stage, steps=3, offload=offload)
    model = build_model(case)
    config = ds_config(case)
    config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1}
    config["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
    }
    engine, _, _, scheduler = zeroshard.initialize(
        model=model, model_parameters=param_groups(model, case), config=config
    )
    batches = global_batches(case, world_size)
    x, y = micro_batch(batches[0], 0, rank, world_size, case.micro)
    engine.backward(engine(x, y))
    engine.step()
    assert engine.skipped_steps == 0

    def params():  # state_dict gathers stage-3 parameters (outside forward they are released)
        return [v.detach().clone() for v in engine.module.state_dict().values()]

    before = params()
    lr_before, scale_before = engine.get_lr(), engine.loss_scale
    if rank == 0:  # poison one gradient on rank 0 only
        handle = engine.module.blocks[1].mlp[0].weight.register_hook(lambda g: g * float("inf"))
    x, y = micro_batch(batches[1], 0, rank, world_size, case.micro)
    engine.backward(engine(x, y))
    engine.step()
    if rank == 0:
        handle.remove()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, params(), strict=True))
    result = (engine.skipped_steps, unchanged, engine.loss_scale, scale_before, engine.get_lr(), lr_before)
    x, y = micro_batch(batches[2], 0, rank, world_size, case.micro)
    engine.backward(engine(x, y))
    engine.step()
    moved = not all(torch.equal(a, b) for a, b in zip(before, params(), strict=True))
    engine.destroy()
    return result + (moved,)


def test_inf_on_one_rank_skips_step_everywhere():
    # stage 3 with NVMe offload decides from the norms and inf/nan flags taken before the gradients were written
    for stage, offload in ((1, "none"), (2, "none"), (3, "none"), (3, "nvme")):
        for skipped, unchanged, scale, scale_before, lr, lr_before, moved in run_on_ranks(_overflow, 2, stage, offload):
            assert skipped == 1
            assert unchanged, "parameters changed on a skipped step"
            assert scale == scale_before / 2, (scale, scale_before)
            assert lr == lr_before, "the lr scheduler must not advance on a skipped step"
            assert moved, "the step after the overflow must update parameters"
