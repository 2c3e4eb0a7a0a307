"""DeepSpeed's ZeRO-3 parameter attributes ([Note: DeepSpeed's parameter attributes] in zero/stage3/ds_param.py):
what `ds_id`, `ds_shape`, `ds_numel`, `ds_persist`, `ds_status` and `ds_tensor` hold through a run at stage 3 (in
memory, parameters offloaded to the CPU, on NVMe), that stages 1-2 set none, that `destroy()` removes them, what
PEFT reads from them; `unwrap_model_for_generation`. DeepSpeed-Chat's save and count on top of them: tests/compat
(dschat_zero3_sft)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups

ATTRIBUTES = ("ds_id", "ds_shape", "ds_numel", "ds_persist", "ds_tensor", "ds_status")


def _parts_cover(engine: Any, rank: int, world_size: int) -> bool:
    """Every parameter's `ds_tensor`s, in rank order, are its whole value (gathered to compare)."""
    import torch.distributed as dist

    import zeroshard

    ok = True
    params = list(engine.module.parameters())
    with zeroshard.GatheredParameters(params):
        for p in params:
            numels = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
            dist.all_gather(numels, torch.tensor([p.ds_tensor.numel()]))
            pieces = [torch.zeros(int(n), dtype=p.ds_tensor.dtype) for n in numels]
            dist.all_gather_object(pieces, p.ds_tensor.detach().cpu())
            ok &= torch.equal(torch.cat(pieces), p.detach().reshape(-1).cpu())
    return ok


def _stage3(rank: int, world_size: int, nvme: str) -> dict[str, Any]:
    import zeroshard
    from zeroshard.runtime.zero.partition_parameters import ZeroParamStatus

    out: dict[str, Any] = {}
    case = Case(stage=3, persistence=200)  # the layer norms' weights stay gathered (the persistent unit)
    model = build_model(case)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    named = dict(engine.module.named_parameters())
    out["shapes"] = all(named[n].ds_shape == s and named[n].ds_numel == s.numel() for n, s in shapes.items())
    out["ids"] = sorted(p.ds_id for p in named.values())
    out["persist"] = {n for n, p in named.items() if p.ds_persist}
    out["status_idle"] = {n: p.ds_status for n, p in named.items() if p.ds_status is not ZeroParamStatus.NOT_AVAILABLE}
    out["released_empty"] = all(p.numel() == 0 for p in named.values() if not p.ds_persist)
    out["ids_in_model_order"] = [p.ds_id for p in named.values()] == sorted(p.ds_id for p in named.values())
    seen: dict[str, Any] = {}
    ahead: list[Any] = []

    def record(module: torch.nn.Module, _: Any) -> None:
        for n, p in module.named_parameters(recurse=False):
            seen[n] = (p.ds_status, p.numel())

    def look_ahead(module: torch.nn.Module, _: Any) -> None:  # the next block, prefetched from the second step on
        ahead.append((named["blocks.1.attn.qkv.weight"].ds_status, named["blocks.1.attn.qkv.weight"].numel()))

    handles = [
        engine.module.blocks[1].attn.qkv.register_forward_pre_hook(record),
        engine.module.blocks[0].attn.qkv.register_forward_pre_hook(look_ahead),
    ]
    for batch in global_batches(case, world_size)[:2]:
        loss = engine(*micro_batch(batch, 0, rank, world_size, case.micro))
        engine.backward(loss)
        engine.step()
    for handle in handles:
        handle.remove()
    out["in_forward"] = seen
    out["ahead"] = ahead
    kept: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, p in named.items():  # DeepSpeed-Chat's save: p.data.cpu() (the buffer itself on the CPU) kept
        fetch = [p] if p.ds_status is ZeroParamStatus.NOT_AVAILABLE else []
        with zeroshard.GatheredParameters(fetch):
            kept[name], expected[name] = p.data.cpu(), p.detach().clone()
    out["kept_valid"] = all(
        t.untyped_storage().nbytes() >= t.numel() * t.element_size() and torch.equal(t, expected[n])
        for n, t in kept.items()
    )

    def held() -> int:  # the released units' buffers: nothing once the blocks handed theirs over
        return sum(u.full.untyped_storage().nbytes() for u in engine.strategy.units if not u.persistent)

    out["held_after_blocks"] = held()
    state = engine.module.state_dict()
    out["held_after_state_dict"] = held(), all(v.untyped_storage().nbytes() > 0 for v in state.values())
    with zeroshard.GatheredParameters([named["blocks.0.attn.qkv.weight"]]):
        out["gathered"] = (named["blocks.0.attn.qkv.weight"].ds_status, named["blocks.1.attn.qkv.weight"].ds_status)
    out["after"] = named["blocks.0.attn.qkv.weight"].ds_status
    out["parts_after_step"] = _parts_cover(engine, rank, world_size)  # views of the shards: the step's values
    out["devices"] = {str(p.ds_tensor.device) for p in named.values()}
    with zeroshard.zero.unwrap_model_for_generation(engine) as unwrapped:
        out["unwrapped"] = (unwrapped is engine, {p.ds_status for p in named.values()})
    engine.destroy()
    out["destroyed"] = [n for n, p in named.items() if any(hasattr(p, a) for a in ATTRIBUTES)]

    for offload in ("cpu", "nvme"):
        param = {"device": offload, "nvme_path": nvme} if offload == "nvme" else {"device": offload}
        config = {**ds_config(case)}
        config["zero_optimization"] = {**config["zero_optimization"], "offload_param": param}
        model = build_model(case)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        parts = [p.ds_tensor for p in engine.module.parameters() if not p.ds_persist]
        out[f"{offload}_parts"] = ({str(t.device) for t in parts}, sum(t.numel() for t in parts))
        out[f"{offload}_ids_fresh"] = min(p.ds_id for p in engine.module.parameters()) > max(out["ids"])
        engine.destroy()

    for stage in (1, 2):
        model = build_model(Case(stage=stage))
        engine, *_ = zeroshard.initialize(model=model, config=ds_config(Case(stage=stage)))
        out[f"stage{stage}"] = [a for p in engine.module.parameters() for a in ATTRIBUTES if hasattr(p, a)]
        engine.destroy()
    return out


def test_stage3_parameters_carry_deepspeeds_attributes(tmp_path) -> None:
    from zeroshard.runtime.zero.partition_parameters import ZeroParamStatus

    ranks = run_on_ranks(_stage3, 2, str(tmp_path))
    for got in ranks:
        assert got["shapes"], "ds_shape/ds_numel are the whole parameter's"
        assert len(set(got["ids"])) == len(got["ids"]), got["ids"]
        assert got["persist"] and all("ln" in n for n in got["persist"]), got["persist"]
        assert set(got["status_idle"]) == got["persist"], got["status_idle"]  # released, but for the persistent
        assert all(s is ZeroParamStatus.AVAILABLE for s in got["status_idle"].values())
        assert got["released_empty"]
        assert got["in_forward"] and all(
            status is ZeroParamStatus.AVAILABLE and numel > 0 for status, numel in got["in_forward"].values()
        ), got["in_forward"]
        assert got["ids_in_model_order"]
        assert [s for s, _ in got["ahead"]] == [ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT], got["ahead"]
        assert all(numel == 0 for _, numel in got["ahead"])  # as the status says: not there yet
        assert got["kept_valid"], "tensors read inside GatheredParameters stay valid after it"
        assert got["held_after_blocks"] == 0 and got["held_after_state_dict"] == (0, True), got  # not a new whole unit
        assert got["gathered"] == (ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE), got["gathered"]
        assert got["after"] is ZeroParamStatus.NOT_AVAILABLE
        assert got["parts_after_step"], "the ranks' ds_tensor parts, concatenated, are the parameter"
        assert got["devices"] == {"cpu"}
        assert got["unwrapped"] == (True, {ZeroParamStatus.AVAILABLE}), got["unwrapped"]
        assert got["destroyed"] == [], got["destroyed"]
        assert got["stage1"] == [] and got["stage2"] == []
        assert got["cpu_parts"][0] == {"cpu"} and got["cpu_parts"][1] > 0
        assert got["nvme_parts"][1] == 0, "a part whose home is NVMe is empty"
        assert got["cpu_ids_fresh"] and got["nvme_ids_fresh"]
    # each rank holds part of the parameters: together every element once
    assert ranks[0]["cpu_parts"][1] + ranks[1]["cpu_parts"][1] > 0


def _peft(rank: int, world_size: int) -> tuple[Any, ...]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import zeroshard

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    before = model.get_nb_trainable_parameters()
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    after = engine.module.get_nb_trainable_parameters()
    plain = sum(p.numel() for p in engine.module.parameters())
    engine.destroy()
    return before, after, plain


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by ds_* attributes: the other tests of
# this file
@pytest.mark.slow
def test_peft_counts_parameters_at_stage_3() -> None:
    for before, after, plain in run_on_ranks(_peft, 2):
        assert plain == 0  # the released parameters' .data is empty, as under DeepSpeed
        assert after == before, (after, before)  # PEFT reads ds_numel


def _rank0_state_dict(rank: int, world_size: int) -> tuple[str, str, int | None, float]:
    import zeroshard

    case = Case(stage=3)
    model = build_model(case)
    config = {**ds_config(case), "zeroshard": {"collective_timeout_s": 30}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    weight = engine.module.blocks[1].attn.qkv.weight
    placeholder = None
    try:
        if rank == 0:  # DeepSpeed-Chat's save_hf_format at stage 3: rank 0 alone
            placeholder = engine.module.state_dict()["blocks.1.attn.qkv.weight"].numel()
        with zeroshard.GatheredParameters([weight]):  # its ZeRO-3 save, every rank
            whole = float(weight.detach().double().abs().sum())
    except zeroshard.ZeroshardError as e:
        return type(e).__name__, str(e), None, 0.0
    return "", "", placeholder, whole


def test_state_dict_on_one_rank_beside_the_others_gathering_returns_deepspeeds_placeholders() -> None:
    """[Note: a state_dict() made alone]: DeepSpeed-Chat's rank-0 `save_hf_format` beside every rank's ZeRO-3 save
    runs as under DeepSpeed: rank 0's `state_dict()` stands down with the placeholders (an empty tensor for a released
    parameter), and every rank's `GatheredParameters` then gathers the whole weight."""
    first, second = run_on_ranks(_rank0_state_dict, 2, timeout=120)
    assert first[:3] == ("", "", 0) and second[:3] == ("", "", None), (first, second)
    assert first[3] == second[3] > 0


def _block_before_backward(rank: int, world_size: int) -> list[torch.Tensor]:
    """Two steps, the second with a whole-model GatheredParameters between its forward and backward (the unit's
    buffer is handed over at the block's end while the forward's saved tensors still view it) or without."""
    import zeroshard

    out = []
    for block in (False, True):
        case = Case(stage=3)
        model = build_model(case)
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=param_groups(model, case), config=ds_config(case)
        )
        for k, batch in enumerate(global_batches(case, world_size)[:2]):
            loss = engine(*micro_batch(batch, 0, rank, world_size, case.micro))
            if block and k == 1:
                with zeroshard.GatheredParameters(list(model.parameters())):
                    pass
            engine.backward(loss)
            engine.step()
        with zeroshard.GatheredParameters(list(model.parameters())):
            out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        engine.destroy()
    return out


def test_a_block_between_forward_and_backward_leaves_the_gradients_alone() -> None:
    for without, with_block in run_on_ranks(_block_before_backward, 2):
        assert torch.equal(without, with_block)
