"""A sparse gradient (`nn.Embedding(sparse=True)`) trains at every stage ([Note: sparse gradients] in
zero/flat/local.py): made dense when it arrives, so 2 ranks match a single-process reference whose embedding is
dense, every step (fp32, 1e-6), with gradient accumulation too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.harness import run_on_ranks

V, D, MICRO, STEPS, LR = 50, 8, 2, 4, 1e-2


class Bag(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(V, D, sparse=sparse)
        self.out = nn.Linear(D, V)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.out(self.emb(idx)).view(-1, V), targets.view(-1))


def _batches(gas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, V, (2 * gas * MICRO, 3), generator=g),) * 2 for _ in range(STEPS)]


def _reference(gas: int) -> tuple[list[float], list[torch.Tensor]]:
    model = Bag(sparse=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches(gas):
        loss = model(x, torch.roll(y, 1, dims=1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in model.parameters()]


def _train(rank: int, world_size: int, stage: int, gas: int) -> tuple[list[float], list[torch.Tensor]]:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.utils import safe_get_full_fp32_param

    model = Bag(sparse=True)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for x, y in _batches(gas):
        total = torch.zeros(())
        for k in range(gas):
            rows = slice((k * world_size + rank) * MICRO, (k * world_size + rank + 1) * MICRO)
            loss = engine(x[rows], torch.roll(y, 1, dims=1)[rows])
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append(float(total) / (world_size * gas))
    params = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    engine.destroy()
    return losses, params


@pytest.mark.parametrize(("stage", "gas"), [(0, 1), (1, 2), (2, 1), (3, 2)])
def test_sparse_embedding_matches_a_dense_reference(stage: int, gas: int) -> None:
    losses, params = run_on_ranks(_train, 2, stage, gas)[0]
    ref_losses, ref_params = _reference(gas)
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= 1e-6 * abs(b), (stage, step, a, b)
    for p, q in zip(params, ref_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _fsdp2_refusal(rank: int, world_size: int) -> str:
    import zeroshard

    model = Bag(sparse=True)
    config = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    config |= {"zero_optimization": {"stage": 3}, "zeroshard": {"backend": "fsdp2"}}
    try:
        zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    except zeroshard.ConfigError as err:
        return str(err)
    return ""


def test_the_fsdp2_backend_refuses_sparse_embeddings_naming_the_module() -> None:
    """FSDP2's reduce-scatter has no sparse kernel: one line at initialize, not an operator error in backward."""
    (message,) = run_on_ranks(_fsdp2_refusal, 1)
    assert "'emb' has sparse=True" in message and "zero backend" in message, message
