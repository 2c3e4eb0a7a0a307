"""The pipeline engine's monitor events on 2 gloo ranks (pp2), as DeepSpeed 0.19.8's pipeline engine writes them
([Note: monitor events] in monitor/telemetry.py): rank 0 (the first stage, which gets the loss broadcast from the
last) writes `Train/Samples/train_loss` after each `train_batch()`'s step and `Train/Samples/eval_loss` after
`eval_batch()`, each the loss the call returns, at the samples counted so far. DeepSpeed 0.19.8 running this
script (its `deepspeed.pipe.PipelineModule`, recorded) wrote train_loss at samples 4, 8, 12 and eval_loss at 12."""

from __future__ import annotations

import csv
import pathlib

import torch
from torch import nn

from helpers.harness import run_on_ranks

DS_TRAIN_SAMPLES, DS_EVAL_SAMPLES = [4, 8, 12], [12]


def _run(rank: int, world_size: int, out: str) -> tuple[list[float], float]:
    import zeroshard
    from zeroshard.pipe import PipelineModule

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 100,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "job"},
    }
    torch.manual_seed(0)
    model = PipelineModule(
        layers=[nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)],
        num_stages=2,
        loss_fn=nn.MSELoss(),
        partition_method="uniform",
    )
    engine, *_ = zeroshard.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)) for _ in range(12)]
    it = iter(data)
    losses = [float(engine.train_batch(it).item()) for _ in range(3)]
    evaluated = float(engine.eval_batch(iter(data)).item())
    engine.destroy()
    return losses, evaluated


def _read(path: pathlib.Path) -> list[tuple[int, float]]:
    with open(path, newline="") as f:
        _, *rows = list(csv.reader(f))
    return [(int(s), float(v)) for s, v in rows]


def test_pipeline_writes_train_and_eval_loss(tmp_path: pathlib.Path) -> None:
    (losses, evaluated), _ = run_on_ranks(_run, 2, str(tmp_path))
    train = _read(tmp_path / "job" / "Train_Samples_train_loss.csv")
    assert [s for s, _ in train] == DS_TRAIN_SAMPLES
    assert [v for _, v in train] == losses
    assert _read(tmp_path / "job" / "Train_Samples_eval_loss.csv") == [(DS_EVAL_SAMPLES[0], evaluated)]
    assert [s for s, _ in _read(tmp_path / "job" / "Train_Samples_lr.csv")] == DS_TRAIN_SAMPLES
