"""ZeRO-3 leaf modules on 2 gloo ranks ([Note: leaf modules]): a Mixtral-style sparse MoE block runs only the experts
its tokens chose, and the two ranks' tokens choose different experts. With each expert a unit the ranks gather
different units and stop with a named error that points at leaf modules; with the block a leaf (by config, or by
DeepSpeed's `set_z3_leaf_modules`) they train, on the zero and the fsdp2 backends, equal to a single-process
reference at every step."""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from helpers.harness import run_on_ranks

V, D, E, SEQ, MICRO, STEPS, LR = 16, 8, 4, 6, 2, 4, 1e-2


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, 2 * D, bias=False)
        self.w2 = nn.Linear(2 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.gelu(self.w1(x)))


class SparseMoeBlock(nn.Module):
    """Tokens go to expert `token id mod E` (a hash router), weighted by the gate's probability for it; an expert no
    token chose does not run, as in Hugging Face's Mixtral."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (tokens % E == e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(x[rows]) * probs[rows, e : e + 1])
        return out


class MoeLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.emb = nn.Embedding(V, D)
        self.moe = SparseMoeBlock()
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).view(-1, D)
        x = x + self.moe(x, idx.view(-1))
        return torch.nn.functional.cross_entropy(self.head(x), targets.view(-1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the global batch: rank 0's rows hold even token ids only (experts 0 and 2), rank 1's odd ones."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        rows = [2 * torch.randint(0, V // 2, (MICRO, SEQ), generator=g) + r for r in range(2)]
        x = torch.cat(rows)
        out.append((x, torch.randint(0, V, x.shape, generator=g)))
    return out


def _config(leaf: dict | None, backend: str = "zero") -> dict:
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if leaf is not None:
        zero["leaf_module"] = leaf
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "zeroshard": {"backend": backend},
    }


def _reference() -> tuple[list[float], list[torch.Tensor]]:
    """The whole global batch in one process; a parameter without a gradient gets a zero one, as a flat shard does
    ([Note: parameters without a gradient] in helpers/parity.py)."""
    model = MoeLM()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for x, y in _batches():
        loss = model(x, y)
        loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in model.parameters()]


def _train(rank: int, world_size: int, config: dict, mark: bool) -> tuple[list[float], list[torch.Tensor]]:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.utils import safe_get_full_fp32_param, set_z3_leaf_modules

    model = MoeLM()
    if mark:
        set_z3_leaf_modules(model, [SparseMoeBlock])
    engine, _, _, _ = zeroshard.initialize(model=model, config=copy.deepcopy(config))
    losses = []
    for x, y in _batches():
        rows = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
    params = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    engine.destroy()
    return losses, [p.detach().clone() for p in params if p is not None]


def _leaf_runs(rank: int, world_size: int) -> list[tuple[str, list[float], list[torch.Tensor]]]:
    runs = [
        ("config names", _config({"names": ["moe"]}), False),
        ("config classes", _config({"classes": ["SparseMoeBlock"]}), False),
        ("set_z3_leaf_modules", _config(None), True),
        ("fsdp2 backend", _config({"name_suffixes": ["moe"]}, "fsdp2"), False),
    ]
    return [(name, *_train(rank, world_size, config, mark)) for name, config, mark in runs]


def test_a_leaf_moe_block_trains_like_the_reference() -> None:
    ref_losses, ref_params = _reference()
    for name, losses, params in run_on_ranks(_leaf_runs, 2, timeout=300)[0]:
        assert len(params) == len(ref_params), name
        for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) <= 1e-6 * abs(b), (name, step, a, b)
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def _without_leaf(rank: int, world_size: int) -> tuple[str, str]:
    os.environ["ZEROSHARD_DIVERGENCE_TIMEOUT_S"] = "10"
    import zeroshard

    try:
        _train(rank, world_size, _config({"classes": []}), False)
    except zeroshard.ZeroshardError as err:
        return type(err).__name__, str(err)
    return "", ""


def test_experts_as_units_stop_with_an_error_naming_leaf_modules() -> None:
    """The same model without a leaf: each expert is a unit (the only repeated blocks), the ranks gather different
    ones, and the error says what to do."""
    outcomes = run_on_ranks(_without_leaf, 2, timeout=120)
    assert all(name == "CollectiveMismatchError" for name, _ in outcomes), outcomes
    assert all("leaf_module" in message and "set_z3_leaf_modules" in message for _, message in outcomes), outcomes
