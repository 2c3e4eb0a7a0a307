"""[Note: a bucket of one parameter reduces its own gradient] (zero/flat/reducer.py): at stage 2, a parameter larger
than the bucket is reduced from its own gradient, so the pool never holds a buffer of its size; a gradient that a
user's hook kept is still staged, and keeps its values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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


def _train(rank: int, world_size: int, keep: str):
    import zeroshard

    model = build_model(CASE)
    kept: list[torch.Tensor] = []
    wte = model.wte.weight
    if keep == "grad":  # registered before initialize's hooks, so it runs first and holds the gradient
        wte.register_post_accumulate_grad_hook(lambda p: kept.append(p.grad))
    if keep == "detach":  # another tensor over the same memory (AccumulateGrad still takes the gradient itself)
        wte.register_hook(lambda g: kept.append(g.detach()))
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
    for ones, pooled_sizes, _, _ in run_on_ranks(_train, 2, ""):
        assert ones, "the case must have buckets of one parameter"
        for pooled in pooled_sizes:
            assert not pooled & ones, (sorted(pooled & ones), sorted(ones))


@pytest.mark.parametrize("keep", ["grad", "detach"])
def test_a_gradient_a_hook_kept_is_staged_and_keeps_its_values(keep: str) -> None:
    for _, _, kept, local_grads in run_on_ranks(_train, 2, keep):
        assert len(kept) == len(local_grads) == CASE.steps
        for got, want in zip(kept, local_grads, strict=True):
            # reduced in place it would hold the sum over ranks (or the other rank's partial sum)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


class _ViewedPosition(nn.Module):
    """A parameter that enters the graph as `h + pos.view(...)`: autograd hands `pos` a view of the add's gradient,
    which backward still reads along `h` (to the embedding)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.emb = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64)
        self.posm = nn.Module()
        self.posm.pos = nn.Parameter(torch.randn(16 * 32) * 0.1)  # registered last: its bucket launches first

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) + self.posm.pos.view(16, 32)
        return nn.functional.cross_entropy(self.head(h), idx.roll(1))


def _viewed(rank: int, world_size: int, stage: int):
    import zeroshard
    from zeroshard.utils import safe_get_full_grad

    model = _ViewedPosition()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 300},
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    idx = torch.arange(16).roll(5 * rank) % 64
    engine.backward(engine(idx))
    grads = {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
    engine.destroy()
    return grads


@pytest.mark.parametrize("stage", [1, 2])
def test_a_gradient_sharing_memory_with_backwards_other_path_is_staged(stage: int) -> None:
    reference: dict[str, torch.Tensor] = {}
    for rank in range(2):
        model = _ViewedPosition()
        model(torch.arange(16).roll(5 * rank) % 64).backward()
        for name, p in model.named_parameters():
            reference[name] = reference.get(name, torch.zeros_like(p)) + p.grad / 2
    for grads in run_on_ranks(_viewed, 2, stage):
        for name, want in reference.items():
            torch.testing.assert_close(grads[name], want, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
