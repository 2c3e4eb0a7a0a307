"""[Note: client optimizers on flat shards]: a client optimizer instance is refused before anything is built, so the
model is left as it was (at stage 3 a refusal after the strategy's build left every parameter empty, its hooks on);
so is one a callable builds (the class, a `functools.partial` of it, a lambda: probed over a throwaway parameter)."""

from __future__ import annotations

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config


def _refused_at_stage3(rank: int, world_size: int) -> list[tuple[str, bool, int]]:
    import functools

    import torch

    import zeroshard

    case = Case(stage=3)
    model = build_model(case)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {k: v for k, v in ds_config(case).items() if k != "optimizer"}
    outcomes = []
    for optimizer in (
        torch.optim.Adafactor(model.parameters()),
        functools.partial(torch.optim.Adafactor, lr=1e-3),
        torch.optim.Adafactor,
        lambda groups: torch.optim.Adafactor(groups, lr=1e-3),  # (before: refused after the build, model emptied)
    ):
        try:
            zeroshard.initialize(model=model, optimizer=optimizer, config=config)
        except zeroshard.ConfigError as error:
            said = str(error)
        else:
            said = "initialized"
        kept = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
        outcomes.append((said, kept, hooks))
    return outcomes


def test_a_refused_client_optimizer_leaves_the_model_as_it_was() -> None:
    for outcomes in run_on_ranks(_refused_at_stage3, 2):
        for said, kept, hooks in outcomes:
            assert said.startswith("optimizer torch.optim.Adafactor: Adafactor factors"), said
            assert kept and hooks == 0
