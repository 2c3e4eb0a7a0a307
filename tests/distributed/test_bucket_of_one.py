"""[Note: a bucket of one parameter reduces its own gradient] (zero/flat/reducer.py): at stage 2, a parameter larger
than the bucket is reduced from its own gradient, so the pool never holds a buffer of its size; a gradient that a
user's hook kept is still staged, and keeps its values."""

from __future__ import annotations

import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups

CASE = Case(stage=2, steps=2, bucket=1000)  # every matrix of the tiny GPT is larger than a bucket


def _sizes_of_one(engine) -> set[int]:
    """numel of every bucket holding one whole, unpadded parameter."""
    sizes = set()
    for group in engine.strategy.layout.groups:
        for bucket in group.buckets:
            if len(bucket.slots) == 1 and group.slots[bucket.slots[0]].numel == bucket.numel:
                sizes.add(bucket.numel)
    return sizes


def _train(rank: int, world_size: int, keep: bool):
    import zeroshard

    model = build_model(CASE)
    kept: list[torch.Tensor] = []
    wte = model.wte.weight
    if keep:  # registered before initialize's hooks, so it runs first and holds the gradient
        wte.register_post_accumulate_grad_hook(lambda p: kept.append(p.grad))
    groups = param_groups(model, CASE)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=groups, config=ds_config(CASE))
    pooled_sizes = []
    local_grads = []
    for batch in global_batches(CASE, world_size):
        x, y = micro_batch(batch, 0, rank, world_size, CASE.micro)
        probe = build_model(CASE)  # this rank's own gradient of the same weights, for the kept tensor
        probe.load_state_dict(engine.module.state_dict())
        probe(x, y).backward()
        local_grads.append(probe.wte.weight.grad.clone())
        engine.backward(engine(x, y))
        engine.step()
        pooled_sizes.append({numel for numel, _ in engine.strategy.pool._free})
    ones = _sizes_of_one(engine)
    engine.destroy()
    return ones, pooled_sizes, [t.clone() for t in kept], local_grads


def test_a_bucket_of_one_parameter_is_reduced_from_its_gradient_and_never_pooled() -> None:
    for ones, pooled_sizes, _, _ in run_on_ranks(_train, 2, False):
        assert ones, "the case must have buckets of one parameter"
        for pooled in pooled_sizes:
            assert not pooled & ones, (sorted(pooled & ones), sorted(ones))


def test_a_gradient_a_hook_kept_is_staged_and_keeps_its_values() -> None:
    for _, _, kept, local_grads in run_on_ranks(_train, 2, True):
        assert len(kept) == len(local_grads) == CASE.steps
        for got, want in zip(kept, local_grads, strict=True):
            # reduced in place it would hold the sum over ranks (or the other rank's partial sum)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
