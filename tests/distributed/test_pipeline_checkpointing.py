"""[Note: pipeline activation checkpointing] in pipe/module.py: the config's `pipeline.activation_checkpoint_interval`
becomes the module's, as DeepSpeed's pipeline engine sets it (before, the key was read and ignored: no layer was
recomputed), and a range is recomputed only when it is checkpointable (a layer with parameters, or every layer
named in `checkpointable_layers`). Counted on 2 ranks (2 stages): the recomputed layers' forwards run once more per
micro-batch, the others not, and the losses stay the same to the bit."""

from __future__ import annotations

from collections import Counter

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
        (3, 0, None, {"linear", "tanh"}),  # each stage one range holding a Linear: all of it again
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
