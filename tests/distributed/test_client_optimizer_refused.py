"""[Note: client optimizers on flat shards]: a client optimizer instance is refused before anything is built, so the
model is left as it was (at stage 3 a refusal after the strategy's build left every parameter empty, its hooks on)."""

from __future__ import annotations

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config


def _refused_at_stage3(rank: int, world_size: int) -> tuple[str, bool, int]:
    import torch

    import zeroshard

    case = Case(stage=3)
    model = build_model(case)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.Adafactor(model.parameters())
    config = {k: v for k, v in ds_config(case).items() if k != "optimizer"}
    try:
        zeroshard.initialize(model=model, optimizer=optimizer, config=config)
    except zeroshard.ConfigError as error:
        said = str(error)
    else:
        said = "initialized"
    kept = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return said, kept, hooks


def test_a_refused_client_optimizer_leaves_the_model_as_it_was() -> None:
    for said, kept, hooks in run_on_ranks(_refused_at_stage3, 2):
        assert said.startswith("optimizer torch.optim.Adafactor: Adafactor factors"), said
        assert kept and hooks == 0
