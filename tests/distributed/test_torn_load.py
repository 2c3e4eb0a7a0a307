"""[Note: a torn load] (checkpoint/torn.py): a load refused by a check on any rank writes nothing on every rank; one
that fails after ranks began writing leaves the engine refusing to train or save, on every rank, until a load
succeeds that restores at least what the failed one would have.

2 gloo ranks, fp32, WarmupLR (the lr differs at every step). Checkpoint "good" is saved after 2 steps; "damaged"
is a copy with one byte of rank 1's optimizer shard flipped (its CRC fails while rank 1 reads it, after rank 0 has
loaded all of its part); "missing" lacks its module-weight files (every rank fails as it opens the first, before
anything is written); "lost" lacks rank 1's optimizer shard and RNG state, which a load opens after writing
tensors, so the checks look for every file first. Stages 2 and 3, and a pp2 pipeline.
"""

from __future__ import annotations

import glob
import os
import shutil
from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups

SAVED = 2
STEPS = 4
STATE_CALLS = ("safe_get_full_optimizer_state", "safe_get_full_fp32_param", "safe_set_full_fp32_param")
CALLS = (
    *STATE_CALLS,  # DeepSpeed's: at stage 3 the first was a KeyError on rank 1, rank 0 waiting in the gather
    "forward",
    "backward",
    "step",
    "save_checkpoint",
    "save_16bit_model",
    "consolidated_state_dict",
    "module_state_dict",
)


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x55]))


def _copy(folder: str, tag: str, new: str) -> str:
    shutil.copytree(os.path.join(folder, tag), os.path.join(folder, new))
    return os.path.join(folder, new)


def _engine(stage: int) -> Any:
    import zeroshard

    case = Case(stage=stage, steps=STEPS)
    model = build_model(case)
    config = ds_config(case)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": case.lr}}
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
    from zeroshard.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param

    param = next(p for p in engine.module.parameters() if p.requires_grad)
    full = torch.zeros(getattr(param, "ds_shape", param.shape))
    calls = {
        "safe_get_full_optimizer_state": lambda: safe_get_full_optimizer_state(param, "exp_avg"),
        "safe_get_full_fp32_param": lambda: safe_get_full_fp32_param(param),
        "safe_set_full_fp32_param": lambda: safe_set_full_fp32_param(param, full),
        "forward": lambda: engine(x, y),
        "backward": lambda: engine.backward(torch.ones((), requires_grad=True)),
        "step": engine.step,
        "save_checkpoint": lambda: engine.save_checkpoint(os.path.join(root, "after"), tag="after"),
        "save_16bit_model": lambda: engine.save_16bit_model(os.path.join(root, "after16")),
        "consolidated_state_dict": engine.consolidated_state_dict,
        "module_state_dict": engine.module_state_dict,
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
        except CheckpointError as e:
            out[name] = str(e)
    return out


def _load_error(engine: Any, root: str, tag: str, **kwargs: Any) -> str:
    return _error_of(lambda: engine.load_checkpoint(root, tag=tag, **kwargs))


def _torn_then_repaired(rank: int, world_size: int, root: str, stage: int) -> dict[str, Any]:
    from zeroshard.checkpoint import CheckpointError
    from zeroshard.checkpoint import load as load_module

    engine = _engine(stage)
    out: dict[str, Any] = {"saved": _train(engine, rank, world_size, range(SAVED))}
    engine.save_checkpoint(root, tag="good")
    out["continued"] = _train(engine, rank, world_size, range(SAVED, STEPS))
    engine.destroy()
    if rank == 0:
        _flip(os.path.join(_copy(root, "good", "damaged"), "optim", "rank00001.safetensors"))
        for path in glob.glob(os.path.join(_copy(root, "good", "missing"), "model", "*.safetensors")):
            os.remove(path)
        lost = _copy(root, "good", "lost")  # rank 1's optimizer shard and RNG state: opened after tensors were written
        os.remove(os.path.join(lost, "optim", "rank00001.safetensors"))
        os.remove(os.path.join(lost, "rng", "rank00001.json"))
    torch.distributed.barrier()

    # refused by a check on rank 1 only: nothing is written anywhere, the engine trains as a fresh one
    engine = _engine(stage)
    before = engine.consolidated_state_dict()
    plan = load_module._plan

    def refused_on_rank_1(*args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            raise CheckpointError("a check failed")
        return plan(*args, **kwargs)

    load_module._plan = refused_on_rank_1  # type: ignore[assignment]
    out["refused"] = _load_error(engine, root, "good")
    load_module._plan = plan  # type: ignore[assignment]
    after = engine.consolidated_state_dict()
    out["untouched"] = all(torch.equal(before[k], after[k]) for k in before) and engine.global_steps == 0
    # the module-weight files are gone: every rank fails opening the first, before writing anything
    out["missing"] = _load_error(engine, root, "missing")
    out["lost"] = _load_error(engine, root, "lost")  # found by the checks: nothing written anywhere
    after = engine.consolidated_state_dict()
    out["untouched"] = out["untouched"] and all(torch.equal(before[k], after[k]) for k in before)
    out["fresh"] = _train(engine, rank, world_size, range(SAVED))
    engine.destroy()

    # torn: rank 0 loads its part, rank 1's optimizer shard fails its CRC
    engine = _engine(stage)
    out["torn"] = _load_error(engine, root, "damaged")
    out["refusals"] = _refusals(engine, rank, world_size, root)
    # loads that restore less than the failed one would have do not repair it
    out["partial_loads"] = [
        _load_error(engine, root, "good", **kwargs) + _refusals(engine, rank, world_size, root).get("step", "")
        for kwargs in ({"load_module_only": True}, {"load_lr_scheduler_states": False})
    ]
    out["lost_module_only"] = _load_error(engine, root, "lost", load_module_only=True)  # needs neither file
    engine.load_checkpoint(root, tag="good")
    out["repaired"] = _train(engine, rank, world_size, range(SAVED, STEPS))
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_a_load_refused_writes_nothing_and_a_torn_one_refuses_to_train_until_repaired(tmp_path, stage):
    ranks = run_on_ranks(_torn_then_repaired, 2, str(tmp_path), stage)
    for rank, out in enumerate(ranks):
        assert "refused, nothing was loaded" in out["refused"] and "rank 1: a check failed" in out["refused"], out
        assert "refused, nothing was loaded" in out["missing"] and "checkpoint file is missing" in out["missing"]
        assert "refused, nothing was loaded" in out["lost"] and "rank00001" in out["lost"], out["lost"]
        assert out["lost_module_only"] == "", out["lost_module_only"]
        assert out["untouched"], rank
        assert out["fresh"] == out["saved"], rank  # bit for bit the run from the same initialisation
        assert "failed part way" in out["torn"] and "rank 1" in out["torn"], out["torn"]
        assert "checksum mismatch" in out["torn"] and "rank00001.safetensors" in out["torn"], out["torn"]
        assert set(out["refusals"]) == set(CALLS), (rank, out["refusals"])
        for call, message in out["refusals"].items():
            prefix = f"{call}(): " if call in STATE_CALLS else f"engine.{call}(): "
            assert message.startswith(f"{prefix}load_checkpoint("), message
            assert "damaged" in message and "the lr scheduler and the optimizer state clears this" in message, message
        for refusal in out["partial_loads"]:  # each load succeeded, and the engine still refuses
            assert refusal.startswith("engine.step(): load_checkpoint("), refusal
        assert out["repaired"] == out["continued"], rank  # the good load resumes the saved run bit for bit


def _pipeline_loads(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from helpers.pipeline import PipeCase, batches, build

    case = PipeCase(2, "1f1b", zero=1)
    data = batches(case, 1)

    def train(engine: Any, steps: range) -> list[float]:
        it = iter([mb for s in steps for mb in data[s][0]])
        return [float(engine.train_batch(data_iter=it)) for _ in steps]

    def refusals(engine: Any, where: str = "after") -> dict[str, str]:
        from zeroshard.checkpoint import CheckpointError

        out = {}
        for name, call in (
            ("train_batch", lambda: train(engine, range(SAVED, SAVED + 1))),
            ("eval_batch", lambda: engine.eval_batch(data_iter=iter(data[0][0]))),
            ("save_checkpoint", lambda: engine.save_checkpoint(os.path.join(root, where), tag="after")),
        ):
            try:
                call()
            except CheckpointError as e:
                out[name] = str(e)
        return out

    engine = build(case)
    train(engine, range(SAVED))
    engine.save_checkpoint(root, tag="good")
    continued = train(engine, range(SAVED, case.steps))
    engine.destroy()
    if rank == 0:  # each stage's folder copied; stage 1's engine state, optimizer or module shard damaged
        damage = {
            "state": "engine_state.pt",
            "optim": "optim/rank00000.safetensors",
            "model": "model/rank00000.safetensors",
        }
        for tag, path in damage.items():
            for stage in ("pipe_stage_00", "pipe_stage_01"):
                _copy(os.path.join(root, stage), "good", tag)
            _flip(os.path.join(root, "pipe_stage_01", tag, path))
        _copy(os.path.join(root, "pipe_stage_00"), "good", "half")  # stage 1 has no folder of this tag
    torch.distributed.barrier()
    out: dict[str, Any] = {"continued": continued}
    # stage 1 refuses its engine state file (a check): no stage writes, the engine trains
    engine = build(case)
    out["refused"] = _load_error(engine, root, "state")
    out["half"] = _load_error(engine, root, "half")  # stage 1 fails before its checks: stage 0 must not wait
    out["untorn"] = refusals(engine)
    engine.destroy()
    # a module-only load failing on stage 1 tears the engine; a later failed load writes nothing and asks no more
    # of the repair than a module-only load
    engine = build(case)
    out["module_torn"] = _load_error(engine, root, "model", load_module_only=True)
    out["nope"] = _load_error(engine, root, "nope")
    out["module_repair"] = _load_error(engine, root, "good", load_module_only=True) + str(refusals(engine))
    engine.destroy()
    # a full load failing on stage 1: every stage refuses until a full load
    engine = build(case)
    out["torn"] = _load_error(engine, root, "optim")
    out["refusals"] = refusals(engine, "after-torn")
    if rank == 0:
        out["mesh_written"] = os.path.exists(os.path.join(root, "after-torn", "pipe_mesh.json"))
    engine.load_checkpoint(root, tag="good")
    out["repaired"] = train(engine, range(SAVED, case.steps))
    engine.destroy()
    out["uneven_repair"] = _uneven_repair(rank, root, case)
    return out


def _uneven_repair(rank: int, root: str, case: Any) -> dict[str, str]:
    """A torn pp2 engine whose last Linear has a bias the "good" checkpoint lacks: a load_module_strict=False load of
    "good" restores every weight on stage 0 and not on stage 1; both stages stay torn (one stage refusing while the
    other sends to it would hang)."""
    from torch import nn

    import zeroshard
    from helpers.pipeline import config, layers
    from zeroshard.pipe import PipelineModule

    specs = layers()
    torch.manual_seed(3)
    specs[-2] = nn.Linear(16, 16, bias=True)
    net = PipelineModule(layers=specs, num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform")
    engine, *_ = zeroshard.initialize(model=net, config=config(case))
    engine.save_checkpoint(os.path.join(root, "biased"), tag="b")
    if rank == 0:
        for stage in ("pipe_stage_00", "pipe_stage_01"):
            _copy(os.path.join(root, "biased", stage), "b", "damaged")
        _flip(os.path.join(root, "biased", "pipe_stage_01", "damaged", "optim", "rank00000.safetensors"))
    torch.distributed.barrier()
    _load_error(engine, os.path.join(root, "biased"), "damaged")
    engine.load_checkpoint(root, tag="good", load_module_strict=False)
    out = {"train_batch": _error_of(lambda: engine.train_batch(data_iter=iter([])))}
    engine.destroy()
    return out


def _error_of(call: Any) -> str:
    from zeroshard.checkpoint import CheckpointError

    try:
        call()
    except CheckpointError as e:
        return str(e)
    return ""


def test_pipeline_loads_agree_across_stages_and_a_torn_one_refuses_on_every_stage(tmp_path):
    """pp2: a check stage 1 fails refuses the load on both stages before either writes; a load failing on stage 1
    after stage 0 loaded leaves both refusing to train, evaluate or save; a failed load that wrote nothing neither
    reports a torn engine nor raises what the repair must restore; a good load repairs and resumes bit for bit."""
    for rank, out in enumerate(run_on_ranks(_pipeline_loads, 2, str(tmp_path))):
        assert "refused, nothing was loaded" in out["refused"], (rank, out["refused"])
        if rank == 0:
            assert "refused, nothing was loaded: another pipeline stage refused its part" in out["half"], out["half"]
        else:
            assert "half: checkpoint directory does not exist" in out["half"], out["half"]
        assert out["untorn"] == {}, (rank, out["untorn"])  # it trained, evaluated and saved
        assert "failed part way on pipeline stage(s) [1]" in out["module_torn"], (rank, out["module_torn"])
        assert "part way" not in out["nope"] and "does not exist" in out["nope"], (rank, out["nope"])
        assert out["module_repair"] == "{}", (rank, out["module_repair"])
        assert "failed part way on pipeline stage(s) [1]" in out["torn"], (rank, out["torn"])
        for call in ("train_batch", "eval_batch", "save_checkpoint"):
            assert out["refusals"].get(call, "").startswith(f"engine.{call}(): load_checkpoint failed part way"), (
                rank,
                out["refusals"],
            )
        assert not out.get("mesh_written", False), rank
        refusal = out["uneven_repair"]["train_batch"]
        assert refusal.startswith("engine.train_batch(): "), (rank, out["uneven_repair"])
        if rank == 0:
            assert "pipeline stage(s) [1] are still torn" in refusal, refusal
        assert out["repaired"] == out["continued"], rank
