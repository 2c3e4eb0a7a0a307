"""`engine.step(lr_kwargs=...)` as DeepSpeed's: the keywords go to the scheduler's step (Megatron-DeepSpeed passes
`{"increment": n}`); it was a TypeError. Without them a scheduler whose step needs an argument gets the train batch
size, as DeepSpeed gives it. A scheduler class passed as `lr_scheduler` is called with the optimizer, as DeepSpeed calls
any callable (it has a `step` attribute and was taken for a scheduler). A scheduler stepping on a metric is left to
its owner."""

from __future__ import annotations

import torch

import zeroshard


class AnnealingLR:  # Megatron's shape: step(increment) with no default
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, self.calls = optimizer, []

    def step(self, increment: int) -> None:
        self.calls.append(increment)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]


def _engine(**kwargs) -> tuple[zeroshard.Engine, AnnealingLR]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config=config, lr_scheduler=AnnealingLR, **kwargs)
    return engine, engine.lr_scheduler


def _train_step(engine: zeroshard.Engine, **kwargs) -> None:
    engine.backward(engine(torch.ones(3, 4)).sum())
    engine.step(**kwargs)


def test_lr_kwargs_reach_the_scheduler_and_a_required_argument_gets_the_batch_size():
    engine, scheduler = _engine()
    _train_step(engine, lr_kwargs={"increment": 7})
    _train_step(engine)
    assert scheduler.calls == [7, 3] and engine.global_steps == 2
    engine.destroy()


def test_a_torch_scheduler_steps_as_before():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    config = {"train_micro_batch_size_per_gpu": 3}
    engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    _train_step(engine)
    _train_step(engine, lr_kwargs=None)
    assert engine.get_lr() == [0.025] and scheduler.last_epoch == 2
    engine.destroy()


def test_a_scheduler_stepping_on_a_metric_is_left_to_its_owner(caplog):
    """ReduceLROnPlateau: DeepSpeed's engine hands it the batch size as the metric every step (the lr is cut every
    patience + 1 steps); here the engine leaves it alone, says so once, and the owner's step(metric) works."""
    import logging

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}

    def plateau(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)

    logging.getLogger("zeroshard").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="zeroshard"):
            engine, *_ = zeroshard.initialize(model=model, config=config, lr_scheduler=plateau)
    finally:
        logging.getLogger("zeroshard").propagate = False
    assert "lr_scheduler ReduceLROnPlateau steps on a metric: engine.step() leaves it alone" in caplog.text
    for _ in range(3):
        _train_step(engine)
    assert engine.get_lr() == [0.1]
    engine.lr_scheduler.step(1.0)
    engine.lr_scheduler.step(2.0)  # worse: cut
    assert engine.get_lr() == [0.05]
    engine.destroy()
