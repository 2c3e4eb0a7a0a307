"""The pipeline's torch schedules as the data changes, in pipe/engine.py. [Note: the schedule's set-up forward]: torch's
schedule runs each stage once more on its first step to infer shapes (stage 0 on the first micro-batch, later stages on
uninitialised tensors); the module's buffers must not keep that call. A BatchNorm on each of 2 stages: after one
train_batch its running statistics are those of a single process running the same micro-batches through the same layers
(before: one batch more, on the later stage from whatever `torch.empty` held), and again after an eval_batch, whose
schedule makes its own set-up forward.

[Note: pipeline input shapes]: batches of other sequence lengths (DeepSpeed's `dynamic_shape`) train with a single
process's losses (before: gloo aborted on the later stage); micro-batches of one batch that differ are refused in one
line on every stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.harness import run_on_ranks

GAS = 2


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)]


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 8, generator=g) * 3 + 1, torch.randn(4, 4, generator=g)) for _ in range(GAS)]


def _run(rank: int, world: int):
    import zeroshard
    from zeroshard.pipe import PipelineModule

    net = PipelineModule(layers=_layers(), loss_fn=nn.functional.mse_loss, num_stages=2, partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},  # the weights stay: only the statistics move
    }
    engine, *_ = zeroshard.initialize(model=net, config=config)
    engine.train_batch(data_iter=iter(_data()))
    trained = {k: v.clone() for k, v in engine.module.state_dict().items() if "running" in k or "batches" in k}
    engine.eval_batch(data_iter=iter(_data()))
    evaluated = {k: v.clone() for k, v in engine.module.state_dict().items() if "running" in k or "batches" in k}
    engine.destroy()
    return trained, evaluated


def test_the_schedules_set_up_forward_leaves_no_batch_in_the_statistics() -> None:
    reference = nn.Sequential(*_layers())
    for x, _ in _data():
        reference(x)
    want = [m for m in reference if isinstance(m, nn.BatchNorm1d)]
    for rank, (trained, evaluated) in enumerate(run_on_ranks(_run, 2)):
        assert trained.keys() == evaluated.keys() and all(torch.equal(trained[k], evaluated[k]) for k in trained), rank
        means = [v for k, v in sorted(trained.items()) if k.endswith("running_mean")]
        counts = [int(v) for k, v in sorted(trained.items()) if k.endswith("num_batches_tracked")]
        assert counts == [GAS], (rank, counts)  # one BatchNorm per stage
        torch.testing.assert_close(means[0], want[rank].running_mean, rtol=1e-6, atol=1e-7)


class _MeanOverTime(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def _sequence_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), _MeanOverTime(), nn.Linear(8, 4)]


def _sequences(lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(2, n, 8, generator=g), torch.randn(2, 4, generator=g)) for n in lengths for _ in range(GAS)]


LENGTHS = [6, 10, 6, 3]


def _shapes(rank: int, world: int):
    import zeroshard
    from zeroshard.pipe import PipelineModule

    layers = _sequence_layers()
    net = PipelineModule(layers=layers, loss_fn=nn.functional.mse_loss, num_stages=2, partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = zeroshard.initialize(model=net, config=config)
    data = iter(_sequences(LENGTHS))
    losses = [float(engine.train_batch(data_iter=data)) for _ in LENGTHS]
    g = torch.Generator().manual_seed(7)
    mixed = iter([(torch.randn(2, 4, 8, generator=g), torch.randn(2, 4)), (torch.randn(2, 5, 8), torch.randn(2, 4))])
    try:
        engine.train_batch(data_iter=mixed)
        refused = None
    except zeroshard.ZeroshardError as err:
        refused = str(err)
    return losses, refused


def test_batches_of_other_lengths_train_with_a_single_process_losses() -> None:
    reference = nn.Sequential(*_sequence_layers())
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    data, want = _sequences(LENGTHS), []
    for step in range(len(LENGTHS)):
        total = 0.0
        for x, y in data[step * GAS : (step + 1) * GAS]:
            loss = nn.functional.mse_loss(reference(x), y)
            (loss / GAS).backward()
            total += loss.item() / GAS
        optimizer.step()
        optimizer.zero_grad()
        want.append(total)
    results = run_on_ranks(_shapes, 2)
    for rank, (losses, refused) in enumerate(results):
        assert losses == pytest.approx(want, rel=1e-6), (rank, losses, want)
        # the first stage reads the inputs; every stage refuses the batch (none waits in the schedule)
        assert refused is not None and "micro-batches of one train_batch/eval_batch have inputs" in refused, rank


def _refusals(rank: int, world: int):
    import zeroshard
    from zeroshard.pipe import PipelineModule

    net = PipelineModule(layers=_sequence_layers(), loss_fn=nn.functional.mse_loss, num_stages=2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "optimizer": {"type": "SGD"}}
    engine, *_ = zeroshard.initialize(model=net, config=config)
    out = []
    bad_labels = iter([(torch.randn(2, 4, 8), [torch.randn(2, 4), 3])] * GAS)
    exhausted = iter(_sequences([4]))  # one batch, then nothing
    for data in (bad_labels, exhausted, exhausted):
        try:
            engine.train_batch(data_iter=data)
            out.append("trained")
        except zeroshard.ZeroshardError as err:
            out.append(f"refused: {err}")
        except StopIteration:
            out.append("stopped")
    return out


def test_a_batch_one_stage_refuses_or_cannot_read_stops_every_stage() -> None:
    """The last stage refuses labels, then the data runs out: every stage raises (before, only the stage that read
    the data did, and the others waited in the schedule until the connection dropped)."""
    for rank, got in enumerate(run_on_ranks(_refusals, 2)):
        assert got[0].startswith("refused: stage 1:") and got[1:] == ["trained", "stopped"], (rank, got)
