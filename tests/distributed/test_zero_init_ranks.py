"""Ranks that seeded differently before building under `zero_init` (accelerate's `set_seed(device_specific=True)`,
`torch.manual_seed(seed + rank)`) start from one model, rank 0's ([Note: one start on every rank] in
loading/agree.py): the model equals the one every rank builds from rank 0's seed, at stage 3 with and without
persistent parameters and on the fsdp2 backend, a custom buffer drawn at random included; ranks that seeded alike
broadcast nothing but the fingerprint."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.nanogpt import NanoGPT, nanogpt_batches, nanogpt_config


class _Noisy(NanoGPT):
    """NanoGPT with a buffer drawn at random (a fixed random projection): buffers are agreed on too."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("projection", torch.randn(8, 8))


def _start(rank: int, world_size: int, backend: str, threshold: int, differ: bool) -> dict[str, Any]:
    import zeroshard

    torch.manual_seed(1234 + (rank if differ else 0))
    with zeroshard.zero_init():
        model = _Noisy()
    config = nanogpt_config(backend)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
    engine, *_ = zeroshard.initialize(model=model, config=config)
    sent = engine.comm_stats.kinds["broadcast"].payload_bytes
    with zeroshard.GatheredParameters(list(model.parameters())):
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    # a first forward on each rank's own rows: with persistent parameters it ran on each rank's own copy
    idx, targets = nanogpt_batches()[0]
    losses = [engine(idx[rows], targets[rows]).item() for rows in (slice(0, 2), slice(2, 4))]
    engine.destroy()
    return {"initial": initial, "buffer": model.projection.clone(), "sent": sent, "losses": losses}


@pytest.mark.parametrize("backend, threshold", [("zero", 0), ("zero", 100_000), ("fsdp2", 0)])
def test_ranks_seeded_differently_start_from_rank_zeros_model(backend: str, threshold: int) -> None:
    alike = run_on_ranks(_start, 2, backend, threshold, False)
    differ = run_on_ranks(_start, 2, backend, threshold, True)
    for rank in (0, 1):
        for name, value in alike[0]["initial"].items():
            assert torch.equal(differ[rank]["initial"][name], value), (rank, name)
        assert torch.equal(differ[rank]["buffer"], alike[0]["buffer"]), rank
        assert differ[rank]["losses"] == alike[0]["losses"], rank
    numel = sum(v.numel() for v in alike[0]["initial"].values()) + alike[0]["buffer"].numel()
    assert all(r["sent"] < 1024 for r in alike), [r["sent"] for r in alike]  # the fingerprint, no values
    assert all(r["sent"] >= 4 * numel for r in differ), ([r["sent"] for r in differ], 4 * numel)


def _block_before(rank: int, world_size: int) -> bool:
    """A block before `initialize` shows rank 0's values (broadcast); `initialize` then starts from them."""
    import zeroshard

    torch.manual_seed(1234 + rank)
    with zeroshard.zero_init():
        model = _Noisy()
    with zeroshard.GatheredParameters([model.wte.weight]):  # before initialize: rank 0's broadcast, as before
        shown = model.wte.weight.detach().clone()
    engine, *_ = zeroshard.initialize(model=model, config=nanogpt_config("zero"))
    with zeroshard.GatheredParameters([model.wte.weight]):
        same = torch.equal(shown, model.wte.weight)
    engine.destroy()
    return same


def test_a_block_before_initialize_shows_the_start_on_every_rank() -> None:
    assert run_on_ranks(_block_before, 2) == [True, True]
