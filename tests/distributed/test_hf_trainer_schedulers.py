"""[Note: the Trainer's schedulers] in hf/schedulers.py, against the plain `transformers.Trainer` (one rank, ZeRO-2,
no `scheduler` block): `lr_scheduler_type="reduce_lr_on_plateau"` cuts the lr after evaluations only (before, the
engine stepped it every step with the batch size as its metric: the lr halved each step), and
`Trainer(optimizers=(optimizer, scheduler))` trains with the user's pair (before, the user's scheduler was replaced
by the Trainer's linear schedule). The logged losses and learning rates equal the plain Trainer's."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.hf_trainer import Tokens, arguments, ds_config, tiny_llama

pytest.importorskip("transformers")

PLATEAU = dict(
    lr_scheduler_type="reduce_lr_on_plateau",
    lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "mode": "max"},  # a falling eval loss is "worse": cut
    eval_strategy="steps",
    eval_steps=1,
    learning_rate=0.05,
    warmup_steps=0,
)


def _recorder() -> Any:
    from transformers import TrainerCallback

    class Logs(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[tuple[float, float]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                self.rows.append((float(logs["loss"]), float(logs["learning_rate"])))

    return Logs()


def _user_pair(model: Any) -> tuple[Any, Any]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def _run(rank: int, world: int, tmp: str, case: str) -> dict[str, list[tuple[float, float]]]:
    import transformers

    from zeroshard.hf import Trainer, TrainingArguments

    torch.set_num_threads(2)
    train, evaluation = Tokens(32), Tokens(8, seed=2)
    overrides: dict[str, Any] = dict(PLATEAU) if case == "plateau" else {"warmup_steps": 0}
    out = {}
    for name, trainer_class, args_class, extra in (
        ("plain", transformers.Trainer, transformers.TrainingArguments, {}),
        ("zeroshard", Trainer, TrainingArguments, {"deepspeed": ds_config(2, optimizer=False)}),
    ):
        model = tiny_llama()
        record = _recorder()
        args = args_class(**arguments(os.path.join(tmp, name), **overrides, **extra))
        pair = _user_pair(model) if case == "user_pair" else (None, None)
        trainer = trainer_class(
            model=model,
            args=args,
            train_dataset=train,
            eval_dataset=evaluation,
            callbacks=[record],
            optimizers=pair,
        )
        trainer.train()
        out[name] = record.rows
    return out


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) for c in ("plateau", "user_pair")]
)  # CI budget: the default suite in 15 minutes on 2 AVX2 cores
def test_the_trainers_schedulers_step_as_the_plain_trainers(tmp_path, case: str) -> None:
    got = run_on_ranks(_run, 1, str(tmp_path), case)[0]
    plain, ours = got["plain"], got["zeroshard"]
    assert len(plain) == len(ours) == 4, (plain, ours)
    assert len({lr for _, lr in plain}) > 1  # the schedule moves (after an evaluation, or every step)
    for step, ((loss_a, lr_a), (loss_b, lr_b)) in enumerate(zip(plain, ours, strict=True)):
        assert math.isclose(lr_a, lr_b, rel_tol=1e-12), (step, plain, ours)
        assert math.isclose(loss_a, loss_b, rel_tol=1e-5), (step, plain, ours)


def _resume_model_only(rank: int, world: int, tmp: str) -> str:
    from zeroshard.errors import ConfigError
    from zeroshard.hf import Trainer, TrainingArguments

    saving = dict(max_steps=2, save_strategy="steps", save_steps=2, save_only_model=True)
    args = TrainingArguments(**arguments(tmp, deepspeed=ds_config(2), **saving))
    Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(32)).train()
    try:
        Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(32)).train(
            resume_from_checkpoint=os.path.join(tmp, "checkpoint-2")
        )
    except ConfigError as err:
        return str(err)
    return ""


@pytest.mark.slow  # CI budget: a message only
def test_resuming_from_a_model_only_checkpoint_says_so(tmp_path) -> None:
    """save_only_model=True at stage 2 leaves the model's weights and no engine checkpoint: the refusal says that
    (it blamed a decoupled save that was never committed)."""
    message = run_on_ranks(_resume_model_only, 1, str(tmp_path))[0]
    assert "it holds the model only, as save_only_model=True saves it" in message, message
