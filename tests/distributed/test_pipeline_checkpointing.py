"""[Note: pipeline activation checkpointing] in pipe/module.py: the config's `pipeline.activation_checkpoint_interval`
becomes the module's, as DeepSpeed's pipeline engine sets it (before, the key was read and ignored: no layer was
recomputed), and a range is recomputed only when it is checkpointable (a layer with parameters, or every layer
named in `checkpointable_layers`). Counted on 2 ranks (2 stages): the recomputed layers' forwards run once more per
micro-batch, the others not, and the losses stay the same to the bit."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from helpers.harness import run_on_ranks

GAS, STEPS = 2, 3
CALLS: Counter[str] = Counter()


class CountedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["linear"] += 1
        return super().forward(x)


class CountedTanh(nn.Tanh):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS["tanh"] += 1
        return super().forward(x)


def _run(rank: int, world: int, config_interval: int, module_interval: int, only: list[str] | None):
    import zeroshard
    from zeroshard.pipe import PipelineModule

    torch.manual_seed(0)
    layers = [m for _ in range(3) for m in (CountedLinear(8, 8), CountedTanh())]
    net = PipelineModule(
        layers=layers,
        num_stages=2,
        loss_fn=nn.functional.mse_loss,
        partition_method="uniform",
        activation_checkpoint_interval=module_interval,
        checkpointable_layers=only,
    )
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)) for _ in range(GAS * STEPS)]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "pipeline": {"activation_checkpoint_interval": config_interval},
    }
    engine, *_ = zeroshard.initialize(model=net, config=config)
    batches = iter(data)
    losses = [float(engine.train_batch(data_iter=batches))]
    CALLS.clear()  # counted after the first step (torch's schedule runs one more forward in its set-up)
    losses += [float(engine.train_batch(data_iter=batches)) for _ in range(STEPS - 1)]
    interval = engine.module.activation_checkpoint_interval
    engine.destroy()
    return {"losses": losses, "calls": dict(CALLS), "interval": interval}


@pytest.mark.parametrize(
    ("config_interval", "module_interval", "only", "recomputed"),
    [
        (1, 0, None, {"linear"}),  # from the config; the parameterless Tanh ranges run once
        (0, 1, ["CountedTanh"], {"tanh"}),  # the module's own, only the named class
        pytest.param(3, 0, None, {"linear", "tanh"}, marks=pytest.mark.slow),  # each stage one range: all again
    ],
)
def test_pipeline_activation_checkpoint_interval(
    config_interval: int, module_interval: int, only: list[str] | None, recomputed: set[str]
) -> None:
    plain = run_on_ranks(_run, 2, 0, 0, None)
    got = run_on_ranks(_run, 2, config_interval, module_interval, only)
    for rank in range(2):
        assert got[rank]["losses"] == plain[rank]["losses"]
        assert got[rank]["interval"] == max(config_interval, module_interval)
        for kind in ("linear", "tanh"):
            base = plain[rank]["calls"].get(kind, 0)
            extra = base if kind in recomputed else 0  # each recomputed forward once more in the backward
            assert got[rank]["calls"].get(kind, 0) == base + extra, (rank, kind, got[rank]["calls"], base)


class _Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h * 0.5


class _Pair(nn.Module):  # DeepSpeed's convention: the previous layer's tuple arrives as one argument
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, aux = inputs
        return torch.tanh(self.a(h)) + aux, aux


class _Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(8, 8)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, aux = inputs
        return self.b(h + aux)


class _Single(nn.Module):  # returns a 1-tuple, which a stage boundary must keep a tuple, as DeepSpeed's
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(8, 8)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        assert isinstance(inputs, tuple), type(inputs)
        return (torch.tanh(self.c(inputs[0] + inputs[-1])),)


class _Unpack(nn.Module):
    def forward(self, inputs: tuple[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        (h,) = inputs
        return h, h * 0.5


def _tuple_layers(one: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    if one:  # the data a 1-tuple; stage 0: Single, Unpack, Single -> a 1-tuple crosses; stage 1: Unpack, Pair, Join
        return [_Single(), _Unpack(), _Single(), _Unpack(), _Pair(), _Join()]
    return [_Split(), _Pair(), _Pair(), _Pair(), _Pair(), _Join()]


def _tuple_data(one: bool = False) -> list[tuple[Any, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)) for _ in range(GAS * STEPS)]
    return [((x,), y) for x, y in data] if one else data


def _tuples(rank: int, world: int, how: str):
    import zeroshard
    from zeroshard.pipe import PipelineModule

    given = {
        "func": dict(activation_checkpoint_interval=1, activation_checkpoint_func=zeroshard.checkpointing.checkpoint)
    }
    given["non_reentrant"] = {
        **given["func"],
        "activation_checkpoint_func": zeroshard.checkpointing.non_reentrant_checkpoint,
    }
    kwargs = given.get(how, given["func"] if how == "use_reentrant_false" else {})
    net = PipelineModule(
        layers=_tuple_layers(how == "one_tuple"),
        num_stages=2,
        loss_fn=nn.functional.mse_loss,
        partition_method="uniform",
        **kwargs,
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    if how == "use_reentrant_false":
        config["pipeline"] = {"use_reentrant": False}
    engine, *_ = zeroshard.initialize(model=net, config=config)
    data = iter(_tuple_data(how == "one_tuple"))
    losses = [float(engine.train_batch(data_iter=data)) for _ in range(STEPS)]
    engine.destroy()
    return losses


@pytest.mark.parametrize(  # slow: CI budget (non_reentrant_checkpoint is checked in tests/unit too)
    "how", ["plain", "func", pytest.param("non_reentrant", marks=pytest.mark.slow), "use_reentrant_false", "one_tuple"]
)
def test_tuple_activations_and_a_given_checkpoint_function_train_as_one_process(how: str) -> None:
    """Layers passing tuples get them as one argument, as DeepSpeed's (they raised TypeError: the tuple was spread);
    DeepSpeed's reentrant `checkpointing.checkpoint` as `activation_checkpoint_func` gives the layers before it their
    gradients (the first stage's inputs need none: its layers got no gradient, silently), as does its
    `non_reentrant_checkpoint` and `pipeline.use_reentrant: false`. Losses of a single process with the same
    clipping, every step. A 1-tuple stays a tuple as the first stage's data and across the stage boundary (it
    arrived as a tensor)."""
    layers = _tuple_layers(how == "one_tuple")
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    data, want = _tuple_data(how == "one_tuple"), []
    for step in range(STEPS):
        total = 0.0
        for x, y in data[step * GAS : (step + 1) * GAS]:
            for layer in layers:
                x = layer(x)
            loss = nn.functional.mse_loss(x, y)
            (loss / GAS).backward()
            total += loss.item() / GAS
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        want.append(total)
    for rank, losses in enumerate(run_on_ranks(_tuples, 2, how)):
        assert losses == pytest.approx(want, rel=1e-6), (rank, how, losses, want)
