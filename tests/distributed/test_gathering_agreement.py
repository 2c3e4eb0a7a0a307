"""[Note: gathering calls agree first] (comm/agreement.py): stage-3 calls that gather on the caller's behalf
(`state_dict()`, `GatheredParameters`, generation's whole-model gather) agree through the store before they
communicate, so a rank-dependent branch is named on every backend. gloo's per-collective fingerprints are switched
off here (ZEROSHARD_VERIFY_COLLECTIVES=0), as NCCL has none: without the agreement, DeepSpeed-Chat's save (rank 0's
`state_dict()` beside every rank's per-parameter `GatheredParameters`) pairs equal-size gathers of different
calls."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest

from helpers.harness import run_on_ranks
from helpers.outcomes import outcome as _outcome
from helpers.parity import Case, build_model, ds_config, param_groups


def _engine(rank: int, verify: str = "0", timeout: str = "8", backend: str = "zero", stage: int = 3) -> Any:
    os.environ["ZEROSHARD_VERIFY_COLLECTIVES"] = verify  # NCCL's default: no per-collective fingerprints
    os.environ["ZEROSHARD_DIVERGENCE_TIMEOUT_S"] = timeout
    import zeroshard

    case = Case(stage=stage)
    model = build_model(case)
    config = {**ds_config(case), "zeroshard": {"backend": backend, "collective_timeout_s": 6}}  # the store's too
    config["zero_optimization"] = {**config["zero_optimization"], "stage3_gather_16bit_weights_on_model_save": True}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    return engine


def _dschat_save(rank: int, world_size: int, one_unit: bool = False) -> tuple[str, str, float, int]:
    import zeroshard

    engine = _one_unit_engine(rank) if one_unit else _engine(rank)
    saved: dict[str, Any] = {}

    def save() -> None:
        if rank == 0:  # save_hf_format at stage 3: rank 0 alone ([Note: a state_dict() made alone])
            saved.update(engine.module.state_dict())
        for p in engine.module.parameters():  # save_zero_three_model: every rank, parameter by parameter
            with zeroshard.GatheredParameters([p]):
                pass

    name, message, seconds = _outcome(save)
    return name, message, seconds, sum(v.numel() for v in saved.values())


def test_a_lone_state_dict_beside_the_others_gathering_stands_down_without_fingerprints() -> None:
    """DeepSpeed-Chat's save: rank 0's `state_dict()` gets DeepSpeed's placeholders, every block then agrees."""
    first, second = run_on_ranks(_dschat_save, 2, timeout=120)
    assert first[:2] == second[:2] == ("", ""), (first, second)
    assert first[2] < 5 and second[2] < 5, (first, second)  # at once, not after a timeout
    assert first[3] == 0, first  # placeholders: every parameter released, so empty (DeepSpeed's too)


def _one_unit_engine(rank: int) -> Any:
    """A model whose parameters are all in the root unit (DeepSpeed-Chat's reward model at a tiny size): a lone
    `state_dict()` would gather exactly what the others' first block gathers."""
    import torch
    from torch import nn

    import zeroshard

    os.environ["ZEROSHARD_VERIFY_COLLECTIVES"], os.environ["ZEROSHARD_DIVERGENCE_TIMEOUT_S"] = "1", "8"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 1}
    config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}  # sharded, not kept whole
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    assert len(engine.strategy.units) == 1, [u.name for u in engine.strategy.units]
    return engine


def test_a_lone_state_dict_stands_down_beside_blocks_of_the_same_units() -> None:
    """The same save with every parameter in one unit: rank 0's `state_dict()` stands down though it would gather the
    same unit as the others' first `GatheredParameters` (before, the two were paired: the fingerprints named the
    difference, DeepSpeed-Chat's step-2 save at stage 3 stopped there)."""
    first, second = run_on_ranks(functools.partial(_dschat_save, one_unit=True), 2, timeout=120)
    assert first[:2] == second[:2] == ("", ""), (first, second)
    assert first[3] == 0, first


def _alone(rank: int, world_size: int) -> tuple[str, str, float]:
    import torch.distributed as dist

    engine = _engine(rank, timeout="3")
    outcome = _outcome(engine.module.state_dict) if rank == 0 else ("", "", 0.0)
    dist.barrier()  # rank 1 waits here (the script's own collective), never in a gathering call
    return outcome


def test_a_gathering_call_made_on_one_rank_alone_names_the_absent_ranks() -> None:
    outcomes = run_on_ranks(_alone, 2, timeout=120)
    name, message, seconds = outcomes[0]
    assert name == "CollectiveTimeoutError", outcomes
    assert "rank 0 made state_dict()" in message and "rank(s) [1] did not make a gathering call within 3s" in message
    assert 3 <= seconds < 20, seconds


def _agreeing(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    import zeroshard

    engine = _engine(rank)
    params = list(engine.module.parameters())
    out: dict[str, Any] = {}
    # different calls that gather the same units agree: rank 0's state_dict(), rank 1's whole-model block
    if rank == 0:
        full = engine.module.state_dict()
    else:
        with zeroshard.GatheredParameters(params):
            full = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out["same_values"] = {
        n: float(v.double().sum()) for n, v in full.items() if n in dict(engine.module.named_parameters())
    }
    # a modifier block: every rank agrees at its end, and rank 0's change reaches every rank
    weight = engine.module.blocks[0].attn.qkv.weight
    with zeroshard.GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            weight.data.fill_(0.5)
    with zeroshard.GatheredParameters([weight]):
        out["modified"] = bool(torch.all(weight == 0.5))
    # a block over parameters gathered already posts nothing: rank 1 alone in an inner block, without a hang
    with zeroshard.GatheredParameters(params):
        if rank == 1:
            with zeroshard.GatheredParameters([weight]):
                out["nested"] = bool(torch.all(weight == 0.5))
    out["store_keys_left"] = _agreement_keys(engine)
    return out


def _agreement_keys(engine: Any) -> int:
    """The posts this rank still has on the store: one call's, at most (older ones are deleted as calls go on)."""
    store = engine.strategy.agreement._default_store()
    space = engine.strategy.agreement._space
    number = int(store.add(f"{space}/calls/{engine.comm.rank}", 0))
    return sum(store.check([f"{space}/{n}/{engine.comm.rank}"]) for n in range(1, number + 1))


def test_calls_that_gather_the_same_units_agree_and_posts_do_not_pile_up() -> None:
    first, second = run_on_ranks(_agreeing, 2, timeout=120)
    assert first["same_values"] == second["same_values"]
    assert first["modified"] and second["modified"] and second["nested"]
    assert first["store_keys_left"] == second["store_keys_left"] == 1


def _modifiers(rank: int, world_size: int, case: str) -> tuple[str, str, float]:
    import zeroshard

    engine = _engine(rank)
    weight = engine.module.blocks[0].attn.qkv.weight

    def block() -> None:
        if case == "modifier":  # rank 0 modifies and broadcasts; rank 1 forgot modifier_rank
            with zeroshard.GatheredParameters([weight], modifier_rank=0 if rank == 0 else None):
                pass
        else:  # rank 0 reads a full fp32 value alone while rank 1 gathers the whole model
            if rank == 0:
                zeroshard.utils.safe_get_full_fp32_param(weight)
            else:
                with zeroshard.GatheredParameters(list(engine.module.parameters())):
                    pass

    return _outcome(block)


def test_a_different_modifier_rank_or_a_lone_full_value_read_is_named_at_entry() -> None:
    for name, message, seconds in run_on_ranks(_modifiers, 2, "modifier", timeout=120):
        assert name == "CollectiveMismatchError" and seconds < 5, (name, message)
        assert "rank 0: GatheredParameters over 1 parameter(s), modifier_rank=0" in message, message
        assert "broadcast from rank 0 at the end" in message and "rank 1: GatheredParameters over 1" in message
    for name, message, seconds in run_on_ranks(_modifiers, 2, "full value", timeout=120):
        assert name == "CollectiveMismatchError" and seconds < 5, (name, message)
        assert "rank 0: safe_get_full_fp32_param" in message and "rank 1: GatheredParameters over" in message, message


def _raising_block(rank: int, world_size: int) -> tuple[str, str, float]:
    import torch.distributed as dist

    import zeroshard

    engine = _engine(rank, timeout="3")
    weight = engine.module.blocks[0].attn.qkv.weight

    def block() -> None:
        with zeroshard.GatheredParameters([weight], modifier_rank=0):
            if rank == 1:
                raise ValueError("the script's own error inside the block")

    try:
        outcome = _outcome(block)
    except ValueError as e:
        outcome = ("ValueError", str(e), 0.0)
    dist.barrier()
    return outcome


def test_a_block_that_raised_on_one_rank_is_named_at_its_end() -> None:
    first, second = run_on_ranks(_raising_block, 2, timeout=120)
    assert first[0] == "CollectiveTimeoutError", first
    assert "rank(s) [1] did not make the end of its GatheredParameters block" in first[1], first[1]
    assert second[0] == "ValueError"


def _fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    import torch

    import zeroshard

    engine = _engine(rank, backend="fsdp2")
    weight = engine.module.blocks[0].attn.qkv.weight
    out: dict[str, Any] = {}
    qkv = engine.module.blocks[0].attn.qkv  # inside a block FSDP2 shows the whole weight on the module
    with zeroshard.GatheredParameters([weight], modifier_rank=0):  # every rank alike: agrees, rank 0's change kept
        if rank == 0:
            qkv.weight.data.fill_(0.25)
    with zeroshard.GatheredParameters([weight]):
        out["modified"] = bool(torch.all(qkv.weight == 0.25))

    def differing() -> None:  # FSDP's own all-gathers carry no fingerprints, on gloo either
        with zeroshard.GatheredParameters([weight], modifier_rank=0 if rank == 0 else None):
            pass

    out["differing"] = _outcome(differing)
    out["full"] = _outcome(lambda: zeroshard.utils.safe_get_full_fp32_param(weight) if rank == 0 else None)
    return out


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by agreement: the zero backend's cases in
# this file
@pytest.mark.slow
def test_the_fsdp2_backend_agrees_too() -> None:
    outs = run_on_ranks(_fsdp2, 2, timeout=120)
    for out in outs:
        assert out["modified"]
        name, message, seconds = out["differing"]
        assert name == "CollectiveMismatchError" and seconds < 5, out
        assert "rank 0: GatheredParameters over 1 parameter(s), modifier_rank=0" in message, message
    name, message, seconds = outs[0]["full"]  # alone on rank 0: the store's timeout, the group's deadline (6 s)
    assert name == "CollectiveTimeoutError" and "rank 0 made safe_get_full_fp32_param" in message, message
    assert "within 6s" in message and 6 <= seconds < 30, seconds


def _mixed_reads(rank: int, world_size: int) -> dict[str, tuple[str, str, float]]:
    """Every backend: rank 0 reads a parameter's whole gradient, rank 1 its master: gathers of the same sizes."""
    from zeroshard import utils

    out = {}
    for label, stage, backend in [("stage 1", 1, "zero"), ("stage 2", 2, "zero"), ("stage 3", 3, "zero")] + [
        ("fsdp2", 3, "fsdp2")
    ]:
        engine = _engine(rank, stage=stage, backend=backend)
        weight = engine.module.blocks[0].attn.qkv.weight
        read = utils.safe_get_full_grad if rank == 0 else utils.safe_get_full_fp32_param
        out[label] = _outcome(functools.partial(read, weight))
        engine.destroy()
    return out


def test_reads_of_different_values_of_one_parameter_are_named_on_every_backend() -> None:
    for out in run_on_ranks(_mixed_reads, 2, timeout=180):
        for label, (name, message, seconds) in out.items():
            assert name == "CollectiveMismatchError" and seconds < 5, (label, name, message)
            assert "rank 0: safe_get_full_grad (engine " in message and "all-gather of the" in message, (label, message)
            assert "gradient" in message and "rank 1: safe_get_full_fp32_param" in message, (label, message)
            assert "fp32 master" in message, (label, message)


def _lone_state_read(rank: int, world_size: int, stage: int) -> tuple[str, str, float]:
    import datetime

    from torch.distributed import distributed_c10d

    from zeroshard import utils

    engine = _engine(rank, stage=stage)
    weight = engine.module.blocks[0].attn.qkv.weight
    store = distributed_c10d._get_default_store()
    if rank == 1:  # waits on the store (a barrier would time out with the group's 6 s deadline first)
        store.wait(["lone read done"], datetime.timedelta(seconds=60))
        return "", "", 0.0
    outcome = _outcome(lambda: utils.safe_get_full_optimizer_state(weight, "exp_avg"))
    store.set("lone read done", "1")
    return outcome


@pytest.mark.slow  # default-suite budget: moved 2026-11-30 (thirty-fifth session; a timeout each)
def test_a_lone_full_value_read_at_stages_0_to_2_names_the_absent_rank() -> None:
    """Stage 2 all-gathers the state's shards; stage 0 checks for the state on every rank (an all-reduce)."""
    for stage in (2, 0):
        name, message, seconds = run_on_ranks(_lone_state_read, 2, stage, timeout=120)[0]
        assert name == "CollectiveTimeoutError", (stage, name, message)
        assert "rank 0 made safe_get_full_optimizer_state" in message and "rank(s) [1]" in message, message
        assert "within 6s" in message and 6 <= seconds < 30, seconds


def _two_engines(rank: int, world_size: int) -> dict[str, Any]:
    import zeroshard

    first, second = _engine(rank), _engine(rank)
    kept = first.module.blocks[0].attn.qkv.weight  # the same on every rank: its engine agrees and gathers
    differs = second.module.blocks[rank].attn.qkv.weight  # a different unit per rank: its engine refuses
    outcome = _outcome(lambda: zeroshard.GatheredParameters([kept, differs]).__enter__())
    units = first.strategy.units_of([kept])
    return {"outcome": outcome, "pins": [u.pins for u in units], "states": [u.state.name for u in units]}


def test_a_block_over_two_engines_that_one_refuses_leaves_nothing_pinned() -> None:
    for out in run_on_ranks(_two_engines, 2, timeout=120):
        assert out["outcome"][0] == "CollectiveMismatchError", out
        assert out["pins"] == [0] and out["states"] == ["SHARDED"], out


def _two_engines_at_exit(rank: int, world_size: int) -> dict[str, Any]:
    import zeroshard

    first, second = _engine(rank, timeout="3"), _engine(rank, timeout="3")
    pair = [first.module.blocks[0].attn.qkv.weight, second.module.blocks[0].attn.qkv.weight]

    def block() -> None:
        with zeroshard.GatheredParameters(pair, modifier_rank=0):
            if rank == 1:  # rank 0's first engine then waits for a broadcast that never comes
                raise ValueError("the script's own error inside the block")

    try:
        outcome = _outcome(block)
    except ValueError as e:
        outcome = ("ValueError", str(e), 0.0)
    units = second.strategy.units_of(pair[1:])
    return {"outcome": outcome, "pins": [u.pins for u in units], "states": [u.state.name for u in units]}


def test_a_block_over_two_engines_whose_first_raises_at_its_end_releases_the_second() -> None:
    first, second = run_on_ranks(_two_engines_at_exit, 2, timeout=120)
    assert first["outcome"][0] == "CollectiveTimeoutError" and second["outcome"][0] == "ValueError"
    for got in (first, second):
        assert got["pins"] == [0] and got["states"] == ["SHARDED"], got


def _extra_block_then_save(rank: int, world_size: int, folder: str) -> tuple[str, str, float]:
    import zeroshard

    engine = _engine(rank)

    def save() -> None:
        if rank == 1:  # a block of its own first: the ranks' calls no longer line up
            with zeroshard.GatheredParameters([engine.module.blocks[0].attn.qkv.weight]):
                pass
        engine.save_16bit_model(
            folder, "model.safetensors"
        )  # it must gather: never placeholders ([Note: a state_dict() made alone])

    return _outcome(save)


def test_save_16bit_model_never_stands_down_to_placeholders(tmp_path) -> None:
    for name, message, seconds in run_on_ranks(_extra_block_then_save, 2, str(tmp_path), timeout=120):
        assert name == "CollectiveMismatchError" and seconds < 5, (name, message)
        assert "rank 0: save_16bit_model" in message and "rank 1: GatheredParameters over 1" in message, message
    assert not (tmp_path / "model.safetensors").exists()


def _lone_state_dict_then_save(rank: int, world_size: int, folder: str) -> tuple[bool, int, bool]:
    import zeroshard  # noqa: F401

    engine = _engine(rank)
    shapes = {tuple(v.shape) for v in engine.module.state_dict().values()} if rank == 0 else set()
    saved = engine.save_16bit_model(folder, "model.safetensors")
    engine.destroy()
    return saved, len(shapes), (0,) in shapes


def test_a_lone_state_dict_stands_down_beside_the_others_save(tmp_path) -> None:
    """DeepSpeed-Chat's shape again, with save_16bit_model on the other ranks: rank 0's own state_dict() gets the
    placeholders (the others' call is the save's, of its own name) and the save then writes the whole model (it
    paired with the lone state_dict() and timed out)."""
    from safetensors.torch import load_file

    results = run_on_ranks(_lone_state_dict_then_save, 2, str(tmp_path), timeout=120)
    assert [saved for saved, _, _ in results] == [True, True], results
    assert results[0][2], results  # placeholders on rank 0, as DeepSpeed's state_dict() gives them
    reference = build_model(Case(stage=3)).state_dict()
    assert {k: tuple(v.shape) for k, v in load_file(str(tmp_path / "model.safetensors")).items()} == {
        k: tuple(v.shape) for k, v in reference.items()
    }
