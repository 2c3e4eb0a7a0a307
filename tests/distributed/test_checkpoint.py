"""Checkpoints on gloo ranks: exact resume, resharding at load, one-rank calls, export, load options.

Every test saves in one spawn of ranks and loads in *another* (fresh processes), as a restarted job does.
"""

from __future__ import annotations

import os
import random
import runpy
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import (
    TINY,
    Case,
    build_model,
    ds_config,
    flat_params,
    global_batches,
    micro_batch,
    param_groups,
    reference_run,
    relative_difference,
)

# -- exact resume --------------------------------------------------------------------------------------------
RESUME_CASES = [(stage, dtype) for dtype in ("fp32", "bf16") for stage in (0, 1, 2, 3)] + [(1, "fp16")]
# a second spawn: the bf16 variants of the fp32 cases at the same stages (bf16 at stage 2 is in the first)
SLOW_RESUME_CASES = [(0, "bf16"), (1, "bf16"), (3, "bf16")]
K, M = 3, 3  # steps before the save, steps after it


def _params(engine) -> torch.Tensor:
    with engine.gathered_for_generation():  # stage 3: the full parameters, not placeholders
        return flat_params(engine.module)


def _resume_model(seed: int) -> torch.nn.Module:
    from zeroshard.models.gpt import GPT

    torch.manual_seed(seed)
    return GPT(replace(TINY, dropout=0.1))  # dropout: the resumed steps depend on the restored torch RNG


def _resume_engine(rank: int, world_size: int, stage: int, dtype: str, seed: int):
    from torch.utils.data import DataLoader, TensorDataset

    import zeroshard
    from zeroshard.checkpoint import ResumableDistributedSampler

    config = ds_config(Case(stage=stage, dtype=dtype, gas=2))
    if dtype == "fp16":  # a short window: the dynamic loss scale changes across the save
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": 2e-3, "warmup_num_steps": 4}}
    model = _resume_model(seed)
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=param_groups(model, Case(stage)), config=config
    )
    tokens = torch.randint(0, TINY.vocab_size, (80, TINY.block_size + 1), generator=torch.Generator().manual_seed(5))
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    sampler = ResumableDistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=3)
    # The sampler's position is saved. The loader's own generator keeps `iter(loader)` from drawing from the
    # global torch RNG: a resumed run creates its iterator at another point of the RNG stream than the
    # uninterrupted one. (initialize's dataloader should be built like this: see docs/checkpoint.md.)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, generator=torch.Generator().manual_seed(0))
    engine.training_dataloader = loader
    return engine


def _train(engine, batches, steps: int) -> list[tuple[float, ...]]:
    """Per micro-step: the loss, lr, loss scale, and one draw of python's and numpy's RNG (restored per rank)."""
    rows = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = next(batches)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        rows.append((loss.item(), engine.get_lr()[0], engine.loss_scale, random.random(), float(np.random.rand())))
    return rows


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _resume_before(rank: int, world_size: int, root: str, cases: list[tuple[int, str]]):
    """Train K steps, save, train M more: the uninterrupted run."""
    out = {}
    for stage, dtype in cases:
        _seed_everything(100 + rank)
        engine = _resume_engine(rank, world_size, stage, dtype, seed=1234)
        batches = iter(engine.training_dataloader)
        _train(engine, batches, K)
        engine.save_checkpoint(os.path.join(root, f"{stage}-{dtype}"), client_state={"case": (stage, dtype)})
        out[(stage, dtype)] = (_train(engine, batches, M), _params(engine))
        engine.destroy()
    return out


def _resume_after(rank: int, world_size: int, root: str, cases: list[tuple[int, str]]):
    """New processes, other seeds and other initial weights: load, then train M steps."""
    out = {}
    for stage, dtype in cases:
        _seed_everything(999)
        engine = _resume_engine(rank, world_size, stage, dtype, seed=4321)
        path, client_state = engine.load_checkpoint(os.path.join(root, f"{stage}-{dtype}"))
        assert path.endswith(f"global_step{K}") and client_state == {"case": (stage, dtype)}
        assert (engine.global_steps, engine.micro_steps, engine.skipped_steps) == (K, 2 * K, 0)
        assert engine.global_samples == K * engine.train_batch_size()
        out[(stage, dtype)] = (_train(engine, iter(engine.training_dataloader), M), _params(engine))
        engine.destroy()
    return out


@pytest.mark.parametrize(
    "cases",
    [
        [case for case in RESUME_CASES if case not in SLOW_RESUME_CASES],
        SLOW_RESUME_CASES,
    ],
    ids=["default", "bf16-stages-0-1-3"],
)
def test_exact_resume_bit_identical(tmp_path, cases):
    """Stages 0-3, fp32 and bf16 (and fp16's loss scaler), accumulation 2, dropout, WarmupLR, resumable sampler:
    a run restarted from a checkpoint in new processes continues bit-for-bit like the uninterrupted run."""
    before = run_on_ranks(_resume_before, 2, str(tmp_path), cases)
    after = run_on_ranks(_resume_after, 2, str(tmp_path), cases)
    for rank in range(2):
        for case in cases:
            rows_before, params_before = before[rank][case]
            rows_after, params_after = after[rank][case]
            assert rows_after == rows_before, f"rank {rank} {case}: losses/lr/RNG differ after resume"
            assert torch.equal(params_after, params_before), f"rank {rank} {case}: parameters differ"


# -- resharding -------------------------------------------------------------------------------------------------
STEPS = 6
SAVE_AT = 3
# name: (saved world size, saved stage, saved accumulation) -> (loaded world size, stage, accumulation in the config,
# accumulation expected after the load); the global batch is 8 (micro 2) throughout.
RESHARD = {
    "2->1 (gas adapted)": ((2, 2, 2), (1, 2, 2, 4)),
    "1->2": ((1, 1, 4), (2, 1, 2, 2)),
    "2->4": ((2, 2, 2), (4, 2, 1, 1)),
    "stage 2->1": ((2, 2, 2), (2, 1, 2, 2)),
    "stage 1->0": ((2, 1, 2), (2, 0, 2, 2)),
    "stage 2->3": ((2, 2, 2), (2, 3, 2, 2)),
    "stage 3->1": ((2, 3, 2), (2, 1, 2, 2)),
    "stage 3, 2->1": ((2, 3, 2), (1, 3, 4, 4)),
}


def _reshard_engine(stage: int, gas: int):
    import zeroshard

    case = Case(stage=stage, gas=gas, steps=STEPS)
    model = build_model(case)
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=param_groups(model, case), config=ds_config(case)
    )
    return engine


def _run_steps(engine, rank: int, world_size: int, first: int, last: int):
    """Steps [first, last) of the shared global batches; per step the local mean loss and the parameters."""
    gas = engine.gradient_accumulation_steps()
    batches = global_batches(Case(stage=0, gas=gas, steps=STEPS), world_size)
    losses, params = [], []
    for batch in batches[first:last]:
        step = []
        for k in range(gas):
            loss = engine(*micro_batch(batch, k, rank, world_size, 2))
            step.append(loss.item())
            engine.backward(loss)
            engine.step()
        losses.append(sum(step) / gas)
        params.append(_params(engine))
    return losses, params


def _reshard_phase(rank: int, world_size: int, root: str, loads: list[str], saves: list[tuple[int, int]]):
    """Load and continue the checkpoints `loads` need; then save (stage, accumulation) checkpoints."""
    out = {}
    for name in loads:
        (n, s, _), (_, stage, gas, expected_gas) = RESHARD[name]
        engine = _reshard_engine(stage, gas)
        engine.load_checkpoint(os.path.join(root, f"w{n}-s{s}"))
        assert engine.gradient_accumulation_steps() == expected_gas, name
        assert engine.global_steps == SAVE_AT and engine.micro_steps == SAVE_AT * expected_gas
        out[name] = _run_steps(engine, rank, world_size, SAVE_AT, STEPS)
        engine.destroy()
    for stage, gas in saves:
        engine = _reshard_engine(stage, gas)
        _run_steps(engine, rank, world_size, 0, SAVE_AT)
        engine.save_checkpoint(os.path.join(root, f"w{world_size}-s{stage}"))
        engine.destroy()
    return out


def test_reshard_world_size_and_stage(tmp_path):
    """Saved on N ranks with stage S, loaded on M ranks with stage S' (no conversion step): the steps after
    the load equal the uninterrupted single-process reference (fp32, 1e-6 relative)."""
    phases = [  # (world size, checkpoints to load, checkpoints to save), in an order that saves before loads
        (2, [], [(2, 2), (1, 2), (3, 2)]),
        (1, ["2->1 (gas adapted)", "stage 3, 2->1"], [(1, 4)]),
        (2, ["1->2", "stage 2->1", "stage 1->0", "stage 2->3", "stage 3->1"], []),
        (4, ["2->4"], []),
    ]
    # The reference trains on the whole global batch (8 rows) in one process: the same for every case.
    ref_losses, ref_params = reference_run(Case(stage=0, gas=2, steps=STEPS), 2)
    for world_size, loads, saves in phases:
        per_rank = run_on_ranks(_reshard_phase, world_size, str(tmp_path), loads, saves)
        for name in loads:
            for j in range(STEPS - SAVE_AT):
                loss = sum(r[name][0][j] for r in per_rank) / world_size
                assert abs(loss - ref_losses[SAVE_AT + j]) <= 1e-6 * abs(ref_losses[SAVE_AT + j]), (name, j)
                assert relative_difference(per_rank[0][name][1][j], ref_params[SAVE_AT + j]) <= 1e-6, (name, j)


# -- export and load options ------------------------------------------------------------------------------------
def _run_recovery_script(ckpt: str, out: str, script: str = "zero_to_fp32.py", *options: str) -> bool:
    """`python ckpt/zero_to_fp32.py ckpt out` (or `zero_to_torch.py ... --dtype D`), in this process."""
    argv, sys.argv = sys.argv, [os.path.join(ckpt, script), ckpt, out, *options]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        return e.code == 0 and os.access(sys.argv[0], os.X_OK)
    finally:
        sys.argv = argv
    return False


def _export_and_options(rank: int, world_size: int, root: str):
    import torch.distributed as dist
    from safetensors.torch import load_file

    from helpers.export_checks import lazy_mode_matches
    from zeroshard.checkpoint import (
        CheckpointError,
        convert_zero_checkpoint_to_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    results = {}
    for dtype in ("fp32", "bf16"):
        engine = _reshard_engine(2, 1) if dtype == "fp32" else None
        if engine is None:
            import zeroshard

            case = Case(stage=2, dtype="bf16", steps=2)
            model = build_model(case)
            engine, *_ = zeroshard.initialize(
                model=model, model_parameters=param_groups(model, case), config=ds_config(case)
            )
        _run_steps(engine, rank, world_size, 0, 2)
        ckpt = os.path.join(root, dtype)
        engine.save_checkpoint(ckpt)
        x = global_batches(Case(stage=0), 1)[0][0][:2]
        with torch.no_grad():
            logits = engine.module(x)
        if rank == 0:
            out = os.path.join(root, f"hf-{dtype}")
            files = convert_zero_checkpoint_to_state_dict(ckpt, out, dtype=dtype, max_shard_size="30KB")
            assert files[-1] == "model.safetensors.index.json" and len(files) > 2
            state = {}
            for f in files[:-1]:
                state.update(load_file(os.path.join(out, f)))
            fresh = build_model(Case(stage=0)).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
            missing, unexpected = fresh.load_state_dict(state, strict=False)
            assert missing == ["lm_head.weight"] and not unexpected  # tied to wte.weight, written once
            with torch.no_grad():
                results[f"{dtype} logits equal"] = torch.equal(fresh(x), logits)
            fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt)
            params = dict(engine.module.named_parameters())  # fp32 run: the module holds the master values
            results[f"{dtype} fp32 state_dict"] = (
                all(
                    fp32[n].dtype == torch.float32 and (dtype == "bf16" or torch.equal(fp32[n], p))
                    for n, p in params.items()
                )
                and fp32["lm_head.weight"] is fp32["wte.weight"]
            )
            results[f"{dtype} lazy_mode"] = lazy_mode_matches(ckpt, fp32)
            if dtype == "fp32":  # the recovery scripts save_checkpoint wrote, as DeepSpeed's: pytorch_model.bin
                scripts = (("zero_to_fp32.py", torch.float32), ("zero_to_torch.py", torch.bfloat16, "--dtype", "bf16"))
                for script, want, *options in scripts:
                    out = os.path.join(root, script)
                    results[script] = _run_recovery_script(ckpt, out, script, *options) and all(
                        v.dtype == want and torch.equal(v, fp32[k].to(want))
                        for k, v in torch.load(os.path.join(out, "pytorch_model.bin")).items()
                    )
            reloaded = load_state_dict_from_zero_checkpoint(build_model(Case(stage=0)), ckpt)
            with torch.no_grad():
                results[f"{dtype} load_state_dict_from_zero_checkpoint"] = (
                    torch.equal(reloaded(x), logits) if dtype == "fp32" else reloaded(x).dtype == torch.float32
                )
        engine.destroy()
    dist.barrier()

    # load_module_only: weights, nothing else; a checkpoint with an extra module fails strict loading.
    engine = _reshard_engine(1, 1)
    path, client_state = engine.load_checkpoint(os.path.join(root, "fp32"), load_module_only=True)
    results["module only"] = (engine.global_steps, client_state) == (0, {})
    results["no latest"] = engine.load_checkpoint(os.path.join(root, "nothing-here")) == (None, None)
    engine.destroy()
    import zeroshard

    bigger = build_model(Case(stage=0))
    bigger.extra = torch.nn.Linear(4, 4)
    engine, *_ = zeroshard.initialize(model=bigger, config=ds_config(Case(stage=1)))
    expected = r"ranks \[0, 1\]: module keys differ.*missing \['extra.weight', 'extra.bias'\]"
    with pytest.raises(CheckpointError, match=expected):
        engine.load_checkpoint(os.path.join(root, "fp32"))
    results["non-strict"] = engine.load_checkpoint(os.path.join(root, "fp32"), load_module_strict=False)[0] is not None
    engine.destroy()

    # exclude_frozen_parameters: frozen weights are not written, and a strict load does not miss them.
    from zeroshard.checkpoint.format import read_metadata

    frozen_case = Case(stage=2, variant="frozen")
    model = build_model(frozen_case)
    config = ds_config(frozen_case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, frozen_case), config=config)
    engine.save_checkpoint(os.path.join(root, "frozen"), exclude_frozen_parameters=True)
    path, _ = engine.load_checkpoint(os.path.join(root, "frozen"))
    excluded = read_metadata(path).excluded
    results["frozen excluded"] = sorted(excluded) == ["blocks.0.ln_1.weight", "wpe.weight"]
    # at stage 3 too, on both backends (the frozen parameters are sharded there; they were written all the same): a
    # fresh engine loads the rest and keeps its own frozen values
    for backend in ("zero", "fsdp2"):
        frozen3_case = Case(stage=3, variant="frozen")
        model3 = build_model(frozen3_case)
        config3 = {**ds_config(frozen3_case), "zeroshard": {"backend": backend}}
        groups3 = param_groups(model3, frozen3_case)
        engine3, *_ = zeroshard.initialize(model=model3, model_parameters=groups3, config=config3)
        x = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(rank))
        engine3.backward(engine3(x, x))
        engine3.step()
        folder = os.path.join(root, f"frozen3-{backend}")
        engine3.save_checkpoint(folder, tag="t", exclude_frozen_parameters=True)
        meta = read_metadata(os.path.join(folder, "t"))
        fresh = build_model(frozen3_case)
        again, *_ = zeroshard.initialize(
            model=fresh, model_parameters=param_groups(fresh, frozen3_case), config=config3
        )
        again.load_checkpoint(folder, tag="t")
        with zeroshard.zero.GatheredParameters(list(engine3.module.parameters())):
            before = [p.detach().clone() for p in engine3.module.parameters()]
        with zeroshard.zero.GatheredParameters(list(again.module.parameters())):
            same = all(torch.equal(a, b) for a, b in zip(before, again.module.parameters(), strict=True))
        excluded = sorted(meta.excluded) == ["blocks.0.ln_1.weight", "wpe.weight"]
        results[f"frozen excluded at stage 3 ({backend})"] = excluded and same
        # a parameter frozen after initialize keeps its optimizer state, so its weights are written with it
        # (excluding them failed the save: "'blocks.1.ln_1.weight'")
        engine3.module.blocks[1].ln_1.weight.requires_grad_(False)
        engine3.save_checkpoint(folder, tag="later", exclude_frozen_parameters=True)
        later = read_metadata(os.path.join(folder, "later")).excluded
        results[f"frozen after initialize written ({backend})"] = sorted(later) == [
            "blocks.0.ln_1.weight",
            "wpe.weight",
        ]
        engine3.destroy()
        again.destroy()
    results["one-rank call"] = _one_rank_call(engine, rank, root)
    engine.destroy()
    return results


def _one_rank_call(engine, rank: int, root: str) -> bool:
    """Only rank 1 loads, then only rank 0 saves: each fails on its own, naming the absent rank (last: the
    ranks' checkpoint call counts no longer match afterwards)."""
    import time

    from zeroshard.checkpoint import CheckpointError

    os.environ["ZEROSHARD_CHECKPOINT_TIMEOUT"] = "2"
    with pytest.raises(CheckpointError) as error:
        if rank == 1:
            engine.load_checkpoint(os.path.join(root, "frozen"))
        else:
            time.sleep(3)  # rank 0 hosts the store: it stays alive while rank 1 waits
            engine.save_checkpoint(root, tag="only-rank-0")
    absent = 1 - rank
    message = str(error.value)
    return f"rank(s) [{absent}] did not reach" in message and "call it on every rank" in message


def test_export_load_options_and_one_rank_calls(tmp_path):
    """Exported safetensors shards (Hugging Face naming and index) give the engine's logits in a fresh model;
    the DeepSpeed-named helpers consolidate fp32 weights; load_module_only, strictness and frozen exclusion
    (at stage 3 too) behave as DeepSpeed's; a save or load called on one rank only raises instead of hanging."""
    results = run_on_ranks(_export_and_options, 2, str(tmp_path), timeout=120)
    assert all(results[0].values()) and all(results[1].values()), results
    assert not os.path.exists(tmp_path / "only-rank-0")


def _full_disk_save(rank: int, world_size: int, root: str):
    import errno

    import zeroshard.checkpoint.rank_files as files_module
    from zeroshard.checkpoint import CheckpointError

    engine = _reshard_engine(2, 1)
    _run_steps(engine, rank, world_size, 0, 1)
    real = files_module._write_safetensors

    def disk_full(*args, **kwargs):  # rank 1's disk fills up while it writes its model file
        raise OSError(errno.ENOSPC, "No space left on device")

    if rank == 1:
        files_module._write_safetensors = disk_full
    try:
        engine.save_checkpoint(root, tag="full")
        message = ""
    except CheckpointError as e:
        message = str(e)
    files_module._write_safetensors = real
    left = sorted(os.listdir(root))
    engine.save_checkpoint(root, tag="later")  # the next save works
    return message, left, sorted(os.listdir(root))


def test_failed_save_removes_its_temporary_directory_and_names_the_disk(tmp_path):
    for message, left, after in run_on_ranks(_full_disk_save, 2, str(tmp_path)):
        assert "rank 1: no space left on the device of " + str(tmp_path) in message, message
        assert "MiB are free" in message and "nothing was committed" in message
        assert left == [], left  # no .tmp.full.* directory keeps the disk full
        assert after == ["later", "latest", "zero_to_fp32.py", "zero_to_torch.py"], after  # (recovery scripts)


# -- saves that cannot work: refused up front, in seconds (one spawn for both) ----------------------------------
def _refused_saves(rank: int, world_size: int, root: str):
    """First a save whose ranks' shards each fit the free space but together do not ([Note: checkpoint space]),
    then the classic mistake `if rank == 0: engine.save_checkpoint(...)` while rank 1 trains on ([Note: one-rank
    checkpoint calls]); a save on every rank in between is not disturbed."""
    import time

    import torch.distributed as dist

    import zeroshard.checkpoint.save as save_module
    import zeroshard.checkpoint.space as space_module
    from zeroshard.checkpoint import CheckpointError

    engine = _reshard_engine(2, 1)
    _run_steps(engine, rank, world_size, 0, 1)
    result = {}
    mine = space_module.bytes_to_write(engine, save_module.engine_state(engine))
    everyone: list[int] = [0] * world_size
    dist.all_gather_object(everyone, mine)
    real = space_module.free_bytes
    space_module.free_bytes = lambda path: max(everyone) * 3 // 2  # as a small tmpfs would report
    with pytest.raises(CheckpointError) as refused:
        engine.save_checkpoint(root, tag="too-big")
    space_module.free_bytes = real
    result["space"] = str(refused.value), sum(everyone), sorted(os.listdir(root))
    engine.save_checkpoint(root, tag="everyone")  # with the real free space it is written
    start = time.monotonic()
    try:
        if rank == 0:
            engine.save_checkpoint(root, tag="rank-0-only")
        _run_steps(engine, rank, world_size, 1, 3)
        result["one rank"] = None, None, time.monotonic() - start, sorted(os.listdir(root))
    except Exception as err:  # noqa: BLE001 - what each rank saw is the result
        result["one rank"] = type(err).__name__, str(err), time.monotonic() - start, sorted(os.listdir(root))
    return result


@pytest.fixture(scope="module")
def refused_saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("refused")
    return root, run_on_ranks(_refused_saves, 2, str(root), timeout=120)


@pytest.mark.slow  # CI budget (the default suite in 15 minutes on 2 AVX2 cores); the other tests here cover saves
def test_a_save_is_refused_up_front_when_the_ranks_together_need_more_than_the_free_space(refused_saves):
    root, results = refused_saves
    for result in results:
        message, need, left = result["space"]
        assert f"not enough space in {root}" in message and "rank(s) [0, 1]" in message, message
        assert f"({need} bytes)" in message and "nothing was written" in message, message
        assert left == [], left  # not even a temporary directory


def test_a_save_on_rank_0_only_fails_both_ranks_in_seconds_naming_the_mistake(refused_saves):
    _, results = refused_saves
    (name0, message0, seconds0, left), (name1, message1, seconds1, _) = (r["one rank"] for r in results)
    assert name0 == name1 == "CheckpointError", (message0, message1)
    assert "save_checkpoint was called on rank(s) [0] only: rank 1 has been in engine." in message0, message0
    assert "not on this rank (1), which has been in engine." in message1, message1
    for message in (message0, message1):
        assert "call it on every rank, not only under `if rank == 0`" in message, message
    assert seconds0 < 20 and seconds1 < 20, (seconds0, seconds1)
    assert left == ["everyone", "latest", "zero_to_fp32.py", "zero_to_torch.py"], left  # the refused wrote nothing
