"""[Note: the Trainer's schedulers] in hf/schedulers.py without a Trainer run: with the config's `scheduler` block the
engine gets none from the Trainer, and a scheduler given as `Trainer(optimizers=...)` is dropped with one warning
(it was dropped without a word); without the block the user's pair is kept unless the config has an optimizer."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from zeroshard.hf.schedulers import scheduler_for_engine


def _given() -> SimpleNamespace:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return SimpleNamespace(_zeroshard_given=(optimizer, scheduler), lr_scheduler=scheduler)


def test_a_config_scheduler_block_drops_the_given_one_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    trainer = _given()
    cfg = SimpleNamespace(scheduler=SimpleNamespace(type="WarmupLR"), optimizer=None)
    logging.getLogger("zeroshard").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="zeroshard"):
            assert scheduler_for_engine(trainer, cfg, 10) is None
    finally:
        logging.getLogger("zeroshard").propagate = False
    assert "the config's scheduler block (WarmupLR) steps the engine's optimizer" in caplog.text


def test_the_given_pair_is_kept_unless_the_config_has_an_optimizer() -> None:
    trainer = _given()
    given = trainer._zeroshard_given[1]
    assert scheduler_for_engine(trainer, SimpleNamespace(scheduler=None, optimizer=None), 10) is given
    built = scheduler_for_engine(trainer, SimpleNamespace(scheduler=None, optimizer=object()), 10)
    assert callable(built) and built is not given and trainer.lr_scheduler is None  # the Trainer's, over the engine's
