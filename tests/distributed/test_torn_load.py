"""[Note: a torn load] (checkpoint/torn.py): a load refused by a check on any rank writes nothing on every rank; one
that fails after ranks began writing leaves the engine refusing to train or save, on every rank, until a load
succeeds.

2 gloo ranks, fp32. Checkpoint "good" is saved after 2 steps; "damaged" is a copy with one byte of rank 1's
optimizer shard flipped (its CRC fails while rank 1 reads it, after rank 0 has loaded all of its part). Stages 2 and
3, and a pp2 pipeline whose stage 1's shard is damaged the same way (stage 0 loads).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups

SAVED = 2
STEPS = 4
CALLS = ("forward", "backward", "step", "save_checkpoint", "save_16bit_model")


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x55]))


def _damaged_copy(root: str, shard: str) -> None:
    """`root`/damaged: `root`/good with one data byte of `shard` (a path inside the tag folder) flipped."""
    shutil.copytree(os.path.join(root, "good"), os.path.join(root, "damaged"))
    _flip(os.path.join(root, "damaged", shard))


def _engine(stage: int) -> Any:
    import zeroshard

    case = Case(stage=stage, steps=STEPS)
    model = build_model(case)
    config = ds_config(case)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    return engine


def _train(engine: Any, rank: int, world_size: int, steps: range) -> list[float]:
    case = Case(stage=engine.zero_optimization_stage(), steps=STEPS)
    batches = global_batches(case, world_size)
    losses = []
    for step in steps:
        loss = engine(*micro_batch(batches[step], 0, rank, world_size, case.micro))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _refusals(engine: Any, rank: int, world_size: int, root: str) -> dict[str, str]:
    """The message each training or saving call raises (every one must raise)."""
    from zeroshard.checkpoint import CheckpointError

    case = Case(stage=engine.zero_optimization_stage(), steps=STEPS)
    x, y = micro_batch(global_batches(case, world_size)[SAVED], 0, rank, world_size, case.micro)
    calls = {
        "forward": lambda: engine(x, y),
        "backward": lambda: engine.backward(torch.ones((), requires_grad=True)),
        "step": engine.step,
        "save_checkpoint": lambda: engine.save_checkpoint(os.path.join(root, "after"), tag="after"),
        "save_16bit_model": lambda: engine.save_16bit_model(os.path.join(root, "after16")),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
        except CheckpointError as e:
            out[name] = str(e)
    return out


def _torn_then_repaired(rank: int, world_size: int, root: str, stage: int) -> dict[str, Any]:
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.checkpoint import load as load_module

    engine = _engine(stage)
    out: dict[str, Any] = {"saved": _train(engine, rank, world_size, range(SAVED))}
    engine.save_checkpoint(root, tag="good")
    out["continued"] = _train(engine, rank, world_size, range(SAVED, STEPS))
    engine.destroy()
    if rank == 0:
        _damaged_copy(root, os.path.join("optim", "rank00001.safetensors"))
    torch.distributed.barrier()

    # refused by a check on rank 1 only: nothing is written anywhere, the engine trains as a fresh one
    engine = _engine(stage)
    before = [p.detach().clone() for p in engine.module.parameters()]
    plan = load_module._plan

    def refused_on_rank_1(*args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            raise CheckpointError("a check failed")
        return plan(*args, **kwargs)

    load_module._plan = refused_on_rank_1  # type: ignore[assignment]
    try:
        engine.load_checkpoint(root, tag="good")
    except CheckpointError as e:
        out["refused"] = str(e)
    load_module._plan = plan  # type: ignore[assignment]
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
    out["steps_after_refusal"] = engine.global_steps
    out["fresh"] = _train(engine, rank, world_size, range(2))
    engine.destroy()

    # torn: rank 0 loads its part, rank 1's optimizer shard fails its CRC
    engine = _engine(stage)
    try:
        engine.load_checkpoint(root, tag="damaged")
    except CheckpointError as e:
        out["torn"] = str(e)
    out["refusals"] = _refusals(engine, rank, world_size, root)
    try:  # a load of the module weights alone does not repair a torn full load
        engine.load_checkpoint(root, tag="good", load_module_only=True)
        out["module_only_refusal"] = _refusals(engine, rank, world_size, root).get("step", "")
    except CheckpointError as e:
        out["module_only_refusal"] = f"load raised: {e}"
    engine.load_checkpoint(root, tag="good")
    out["repaired"] = _train(engine, rank, world_size, range(SAVED, STEPS))
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_a_load_refused_writes_nothing_and_a_torn_one_refuses_to_train_until_repaired(tmp_path, stage):
    ranks = run_on_ranks(_torn_then_repaired, 2, str(tmp_path), stage)
    for rank, out in enumerate(ranks):
        assert "refused, nothing was loaded" in out["refused"] and "rank 1: a check failed" in out["refused"], out
        assert out["untouched"] and out["steps_after_refusal"] == 0, rank
        assert out["fresh"] == ranks[rank]["saved"], rank  # bit for bit the run from the same initialisation
        assert "failed part way" in out["torn"] and "rank 1" in out["torn"], out["torn"]
        assert "checksum mismatch" in out["torn"] and "rank00001.safetensors" in out["torn"], out["torn"]
        assert set(out["refusals"]) == set(CALLS), (rank, out["refusals"])
        for call, message in out["refusals"].items():
            assert message.startswith(f"engine.{call}(): load_checkpoint("), message
            assert "damaged" in message and "build a new engine" in message, message
        assert out["module_only_refusal"].startswith("engine.step(): load_checkpoint("), out["module_only_refusal"]
        assert out["repaired"] == out["continued"], rank  # the good load resumes the saved run bit for bit


def _pipeline_torn(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from helpers.pipeline import PipeCase, batches, build
    from zeroshard.checkpoint import CheckpointError

    case = PipeCase(2, "1f1b", zero=1)
    data = batches(case, 1)

    def train(engine: Any, steps: range) -> list[float]:
        it = iter([mb for s in steps for mb in data[s][0]])
        return [float(engine.train_batch(data_iter=it)) for _ in steps]

    engine = build(case)
    train(engine, range(SAVED))
    engine.save_checkpoint(root, tag="good")
    continued = train(engine, range(SAVED, case.steps))
    engine.destroy()
    if rank == 0:  # each stage's folder copied, stage 1's shard damaged
        for stage in ("pipe_stage_00", "pipe_stage_01"):
            shutil.copytree(os.path.join(root, stage, "good"), os.path.join(root, stage, "damaged"))
        _flip(os.path.join(root, "pipe_stage_01", "damaged", "optim", "rank00000.safetensors"))
    torch.distributed.barrier()
    out: dict[str, Any] = {}
    engine = build(case)
    try:
        engine.load_checkpoint(root, tag="damaged")
    except CheckpointError as e:
        out["torn"] = str(e)
    for name, call in (
        ("train_batch", lambda: train(engine, range(SAVED, SAVED + 1))),
        ("eval_batch", lambda: engine.eval_batch(data_iter=iter(data[0][0]))),
        ("save_checkpoint", lambda: engine.save_checkpoint(os.path.join(root, "after"), tag="after")),
    ):
        try:
            call()
        except CheckpointError as e:
            out[name] = str(e)
    engine.load_checkpoint(root, tag="good")
    out["repaired"], out["continued"] = train(engine, range(SAVED, case.steps)), continued
    engine.destroy()
    return out


def test_a_pipeline_load_failing_on_one_stage_leaves_every_stage_refusing(tmp_path):
    """Stage 0 loads its folder, stage 1's shard fails its CRC: both stages' ranks refuse to train, evaluate or
    save; a good load repairs both and resumes the saved run bit for bit."""
    for rank, out in enumerate(run_on_ranks(_pipeline_torn, 2, str(tmp_path))):
        assert "failed part way on pipeline stage(s) [1]" in out["torn"], (rank, out["torn"])
        for call in ("train_batch", "eval_batch", "save_checkpoint"):
            assert out.get(call, "").startswith(f"engine.{call}(): load_checkpoint failed part way"), (rank, out)
        assert out["repaired"] == out["continued"], rank
