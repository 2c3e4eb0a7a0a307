"""Which scheduler the engine steps and which one the Hugging Face Trainer holds.

[Note: the Trainer's schedulers]
- `Trainer(optimizers=(optimizer, scheduler))` without the config's `optimizer` block: the engine trains the user's
  optimizer and steps the user's scheduler, as the plain Trainer steps them (the scheduler was dropped and the
  Trainer's `lr_scheduler_type` schedule built over the user's optimizer instead, matching neither the plain Trainer
  nor DeepSpeed's integration, which drops both).
- Otherwise the Trainer's own `create_scheduler` over the engine's optimizer, as under DeepSpeed; with the config's
  `scheduler` block that one, and a scheduler given to the Trainer is dropped with one warning (DeepSpeed's
  integration drops it without one).
- A scheduler that steps on a metric (`ReduceLROnPlateau`, transformers' `GreedyLR`) is not stepped by the engine
  (optim/schedulers/base.py `steps_on_a_metric`): `trainer.lr_scheduler` is the scheduler itself, which the Trainer
  recognises and steps with the evaluation metric after each evaluation, as without DeepSpeed. Before, the engine
  stepped it every optimizer step with the train batch size as the metric, which never improves: the lr halved at
  every step. The engine still holds it, so checkpoints carry its state.
Tested in tests/distributed/test_hf_trainer_schedulers.py.
"""

from __future__ import annotations

import functools
from typing import Any

from zeroshard.engine import Engine
from zeroshard.hf.link import EngineLink, EngineScheduler
from zeroshard.optim.schedulers.base import steps_on_a_metric
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def scheduler_for_engine(trainer: Any, cfg: Any, num_training_steps: int) -> Any:
    """`initialize`'s `lr_scheduler`: None with the config's `scheduler` block (a scheduler given to the Trainer is
    then dropped, with one warning), else the user's, or a callable building the Trainer's over the engine's
    optimizer."""
    optimizer, scheduler = getattr(trainer, "_zeroshard_given", (None, None))
    if cfg.scheduler is not None:
        if scheduler is not None:
            log_rank(
                logger,
                30,
                f"the config's scheduler block ({cfg.scheduler.type}) steps the engine's optimizer: the scheduler "
                "given as Trainer(optimizers=...) is not used (remove the block to use it)",
            )
        return None
    if scheduler is not None and optimizer is not None and cfg.optimizer is None:
        return scheduler
    trainer.lr_scheduler = None  # create_scheduler builds one only where there is none
    return functools.partial(_trainer_scheduler, trainer, num_training_steps)


def scheduler_for_trainer(engine: Engine, link: EngineLink) -> Any:
    """`trainer.lr_scheduler` while the engine trains: a metric-stepped scheduler itself, else the engine's view."""
    if steps_on_a_metric(engine.lr_scheduler):
        return engine.lr_scheduler
    return EngineScheduler(link)


def _trainer_scheduler(trainer: Any, num_training_steps: int, optimizer: Any) -> Any:
    return trainer.create_scheduler(num_training_steps, optimizer=optimizer)
