"""Pipeline parallelism (pp2 on 2 ranks, pp2 x dp2 on 4) against a single-process reference, every step and
an eval_batch after the last.

GPipe and 1F1B, ZeRO 0 and 1 over the data-parallel dimension, clipping over the global norm of all stages
(a clip small enough to act every step; with a weight tied across the stages, its gradient counted once), and a
checkpoint saved and loaded within the same mesh.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from helpers.harness import run_on_ranks
from helpers.pipeline import PipeCase, build, config, evaluate, layers, reference, tied_specs, train
from zeroshard.errors import ConfigError

RTOL = 1e-5

CASES_2 = [
    PipeCase(2, "gpipe"),
    PipeCase(2, "1f1b"),
    PipeCase(2, "1f1b", zero=1, clip=0.05),
    PipeCase(2, "1f1b", tied=True),
    PipeCase(2, "gpipe", checkpoint_every=2),
    PipeCase(2, "interleaved", tied=True),
    PipeCase(2, "1f1b", zero=1, clip=0.05, tied=True, sgd=True),  # [Note: tied copies in the norm]
    PipeCase(2, "1f1b", gas=1, clip=0.05, sgd=True),  # fewer micro-batches than stages (torch's 1F1B refused them)
]
CASES_4 = [
    PipeCase(2, "gpipe", zero=1),
    PipeCase(2, "1f1b", zero=0),
    PipeCase(2, "1f1b", zero=1, clip=0.05),
    PipeCase(2, "interleaved", zero=1, clip=0.05),
    PipeCase(2, "gpipe", zero=0, clip=0.05, tied=True, sgd=True),
]


def _run(rank: int, world_size: int, cases: list[PipeCase]) -> list[list[float]]:
    out = []
    for case in cases:
        engine = build(case)
        out.append(train(engine, case, range(case.steps)) + [evaluate(engine, case)])
        engine.destroy()
    return out


def _check(cases: list[PipeCase], per_rank: list[list[list[float]]], world_size: int) -> None:
    failures = []
    for i, case in enumerate(cases):
        want = reference(case, world_size // case.stages)
        for rank in range(world_size):
            got = per_rank[rank][i]
            bad = [
                (s, g, w)
                for s, (g, w) in enumerate(zip(got, want, strict=True))
                if not math.isclose(g, w, rel_tol=RTOL)
            ]
            if bad:
                failures.append(f"{case.name} rank {rank}: (step, got, reference) {bad}")
    assert not failures, "\n".join(failures)


def test_pipeline_two_ranks() -> None:
    _check(CASES_2, run_on_ranks(_run, 2, CASES_2), 2)


def test_pipeline_four_ranks_pp2_dp2() -> None:
    _check(CASES_4, run_on_ranks(_run, 4, CASES_4), 4)


def _resume(rank: int, world_size: int, case: PipeCase, folder: str) -> tuple[list[float], list[float]]:
    engine = build(case)
    first = train(engine, case, range(2))
    engine.save_checkpoint(folder, tag="two")
    straight = train(engine, case, range(2, case.steps))
    engine.destroy()
    resumed_engine = build(case)
    resumed_engine.load_checkpoint(folder, tag="two")
    resumed = train(resumed_engine, case, range(2, case.steps))
    return first + straight, first + resumed


@pytest.mark.parametrize(("world_size", "serial"), [(2, False), (4, False), (4, True)])
def test_pipeline_checkpoint_resume(world_size: int, serial: bool, tmp_path: Path) -> None:
    """`serial`: pipeline_loading_checkpoint, the stages load in turns (each turn ends through the store)."""
    case = PipeCase(2, "1f1b", zero=1, serial_load=serial)
    per_rank = run_on_ranks(_resume, world_size, case, str(tmp_path))
    want = reference(case, world_size // case.stages)[:-1]
    for straight, resumed in per_rank:
        assert straight == resumed, (straight, resumed)
        assert all(math.isclose(g, w, rel_tol=RTOL) for g, w in zip(straight, want, strict=True)), (straight, want)


REFUSALS = [
    ({"zero_optimization": {"stage": 2}}, "stages 0 and 1 only"),
    ({"pipeline": {"schedule": "gpipe", "virtual_stages": 2}}, "only with"),
    ({"pipeline": {"stages": 3}}, "num_stages=1"),
    ({"pipeline": {"micro_batches": 3}}, "unknown keys"),
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation is false, which a PipelineModule"),
    ({"checkpoint": {"use_node_local_storage": True}}, "use_node_local_storage is not supported with a PipelineModule"),
    ({"hybrid_engine": {"enabled": True}}, "hybrid_engine is not supported with a PipelineModule"),
]


def _refused(rank: int, world_size: int, stages: int, refusals: list[tuple[dict[str, Any], str]]) -> list[str]:
    import zeroshard
    from zeroshard.pipe import PipelineModule

    messages = []
    for change, _ in refusals:
        net = PipelineModule(layers=tied_specs(), num_stages=stages, loss_fn=nn.functional.mse_loss)
        try:
            zeroshard.initialize(model=net, config={**config(PipeCase(stages)), **change})
            messages.append("accepted")
        except ConfigError as e:
            messages.append(str(e))
    return messages


def test_pipeline_refusals() -> None:
    """What the pipeline engine does not do is refused at initialize (one process, one stage)."""
    (messages,) = run_on_ranks(_refused, 1, 1, REFUSALS)
    for (change, expected), message in zip(REFUSALS, messages, strict=True):
        assert expected in message, (change, message)


def _curriculum(rank: int, world_size: int) -> list[int]:
    import zeroshard
    from zeroshard.pipe import PipelineModule

    case = PipeCase(1, steps=3)
    net = PipelineModule(layers=layers(), num_stages=1, loss_fn=nn.functional.mse_loss)
    schedule = {"total_curriculum_step": 4, "difficulty_step": 8}
    curriculum = {"enabled": True, "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear"}
    engine, _, _, _ = zeroshard.initialize(
        model=net, config={**config(case), "curriculum_learning": {**curriculum, "schedule_config": schedule}}
    )
    seen = []
    for step in range(3):
        train(engine, case, range(step, step + 1))
        seen.append(engine.curriculum_scheduler_legacy.get_current_difficulty())
    engine.destroy()
    return seen


def test_pipeline_train_batch_moves_the_legacy_curriculum() -> None:
    """[Note: legacy curriculum learning]: each train_batch sets the difficulty of the step it takes (the stages
    read it from the engine, as Megatron-DeepSpeed's do)."""
    (seen,) = run_on_ranks(_curriculum, 1)
    assert seen == [16, 32, 48]


def _io(rank: int, world_size: int) -> list[list[int]]:
    import torch

    import zeroshard
    from zeroshard.pipe import PipelineModule

    net = PipelineModule(layers=layers(), num_stages=2, loss_fn=nn.functional.mse_loss)
    engine, *_ = zeroshard.initialize(model=net, config=config(PipeCase(2)))
    data = torch.utils.data.TensorDataset(torch.arange(8))
    return [b[0].tolist() for b in engine.deepspeed_io(data, batch_size=4)]


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by pipeline parity:
# test_pipeline_four_ranks_pp2_dp2
@pytest.mark.slow
def test_deepspeed_io_reads_the_replicas_share_in_order() -> None:
    """Two stages of one replica: each stage's rank reads the whole data, in order, as the pipeline's own loader."""
    assert run_on_ranks(_io, 2) == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2


def _offloaded(rank: int, world_size: int) -> tuple[list[str], bool]:
    import zeroshard

    case = PipeCase(2, "1f1b", zero=1)
    engine = build(case)
    train(engine, case, range(1))
    before = evaluate(engine, case)
    engine.offload_states()  # every kind: [Note: offloaded states]
    refused = []
    for call in (lambda: evaluate(engine, case), lambda: train(engine, case, range(1, 2))):
        try:
            call()
            refused.append("")
        except zeroshard.ZeroshardError as e:
            refused.append(str(e).split(":")[0])
    engine.reload_states()
    after = evaluate(engine, case)
    engine.destroy()
    return refused, before == after


def test_pipeline_eval_and_train_batch_refuse_while_offloaded() -> None:
    """With the states offloaded a pipeline's eval_batch (the parameters away) and train_batch refuse in one line on
    every stage, before any stage communicates; after reload_states() the evaluation is unchanged."""
    for refused, same in run_on_ranks(_offloaded, 2):
        assert refused == ["eval_batch", "train_batch"] and same, (refused, same)


def _logits(rank: int, world_size: int) -> list[Any]:
    import copy

    import torch

    import zeroshard
    from zeroshard.pipe import PipelineModule

    torch.manual_seed(0)
    seq = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)]
    whole = nn.Sequential(*copy.deepcopy(seq))
    data = [(torch.randn(2, 8), torch.randn(2, 3)) for _ in range(2)]
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD"}}
    engine, *_ = zeroshard.initialize(model=PipelineModule(layers=seq, num_stages=2, loss_fn=nn.MSELoss()), config=cfg)
    loss, logits = engine.eval_batch(iter(data), return_logits=True)
    outputs = engine.eval_batch(iter(data), compute_loss=False)  # DeepSpeed's: the outputs' mean, last stage only
    module = engine.module  # DeepSpeed's attributes: its layer range, the micro-batches a train_batch runs
    span = (module._local_start, module._local_stop, len(module.forward_funcs), engine.micro_batches)
    engine.destroy()
    chunked = PipelineModule(layers=[nn.Linear(8, 8) for _ in range(4)], num_stages=2, loss_fn=nn.MSELoss())
    chunked.interleave(2)  # the interleaved schedule re-splits the layers: the loss module stays
    span = (*span, isinstance(chunked.loss_fn, nn.MSELoss))
    with torch.no_grad():
        want = whole(data[1][0])  # DeepSpeed's: the last micro-batch's outputs
        mean = sum(float(nn.functional.mse_loss(whole(x), y)) for x, y in data) / 2
        mean_outputs = (whole(data[0][0]) + whole(data[1][0])) / 2
    close = None if logits is None else torch.allclose(logits, want)
    averaged = None if outputs is None else torch.allclose(outputs, mean_outputs)
    return [math.isclose(float(loss), mean, rel_tol=1e-6), close, span, averaged]


def test_eval_batch_logits_and_outputs_as_deepspeed() -> None:
    first, last = run_on_ranks(_logits, 2)
    assert first[:2] == [True, None] and last[:2] == [True, True], (first, last)
    (start0, stop0, count0, micro0, kept0), (start1, stop1, count1, micro1, kept1) = first[2], last[2]
    assert kept0 and kept1
    assert (start0, stop1, stop0 - start0, stop1 - start1) == (0, 3, count0, count1) and stop0 == start1 > 0
    assert micro0 == micro1 == 2
    assert first[3] is None and last[3] is True, (first[3], last[3])  # eval_batch(compute_loss=False)


def _pair_loss(output: Any, labels: tuple[Any, Any]) -> Any:
    return ((output - labels[0]) ** 2 * labels[1]).mean()


def _dict_loss(output: Any, labels: dict[str, Any]) -> Any:
    return ((output - labels["y"]) ** 2).mean()


def _labels(rank: int, world_size: int) -> list[Any]:
    import copy

    import torch

    import zeroshard
    from zeroshard.pipe import PipelineModule

    torch.manual_seed(0)
    x, y, w = torch.randn(2, 8), torch.randn(2, 1), torch.rand(2, 1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD"}}
    out: list[Any] = []
    for loss_fn, label in ((None, 0), (_pair_loss, (y, w)), (_dict_loss, {"y": y})):
        seq = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)]
        whole = nn.Sequential(*copy.deepcopy(seq))
        engine, *_ = zeroshard.initialize(model=PipelineModule(layers=seq, num_stages=2, loss_fn=loss_fn), config=cfg)
        got = engine.eval_batch(iter([(x, label), (x, label)]))  # two equal micro-batches: their mean is one's
        with torch.no_grad():
            want = whole(x) if loss_fn is None else loss_fn(whole(x), label)
        out.append(math.isclose(float(got.sum()), float(want.sum()), rel_tol=1e-6))
        if loss_fn is _dict_loss:  # DeepSpeed's eval_batch arguments: one micro-batch, the loss on the last stage
            one = engine.eval_batch(iter([(x, label)]), bcast_loss=False, num_micro_batches=1)
            out.append(None if one is None else math.isclose(float(one), float(want), rel_tol=1e-6))
        engine.destroy()
    return out


@pytest.mark.slow  # CI budget: the pipeline compat script (tests/compat) passes labels as DeepSpeed's do
def test_pipeline_labels_reach_the_loss_as_deepspeeds_do() -> None:
    """A dataset's int label with no loss_fn (DeepSpeed's TestPipeModuleSequential: the last stage's output is what
    eval_batch returns) failed joining the labels; a tuple of label tensors reaches the loss function whole (only its
    first tensor did), a dict as it is; eval_batch's `num_micro_batches` and `bcast_loss` act as DeepSpeed's."""
    assert run_on_ranks(_labels, 2) == [[True, True, True, None], [True, True, True, True]]
