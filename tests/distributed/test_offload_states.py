"""engine.offload_states(include=...) / reload_states(): DeepSpeed's five kinds of state move to the host and back
([Note: offloaded states] in offload/states.py), the calls that would use them refuse in between, the memory report
follows, and training continues bit for bit."""

from __future__ import annotations

import json
import os

import torch

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups

COLUMNS = ("params", "persistent_params", "master_weights", "optimizer_state", "gradients")
HOST = ("host_params", "host_master_weights", "host_optimizer_state", "host_gradients")


def _refusals(engine, folder: str, x, y) -> list[str]:
    """The first words of each call's refusal ("" where a call was not refused)."""
    import zeroshard

    param = next(engine.module.parameters())
    calls = [  # each would read or write empty storages
        lambda: engine(x, y),
        lambda: engine.generate(x),
        engine.step,
        lambda: engine.load_checkpoint(folder, "s"),
        lambda: engine.load_module_state_dict({"module": {}}),
        lambda: zeroshard.utils.safe_get_full_fp32_param(param),
        lambda: zeroshard.utils.safe_get_full_grad(param),
        lambda: zeroshard.utils.safe_set_full_optimizer_state(param, torch.zeros(1), "exp_avg"),
    ]
    if engine.zero_optimization_stage() < 3:
        calls.append(engine.zero_grad)  # writes the gradient buffers (stage 3's exist from reduction to step only)
    if engine.zero_optimization_stage() == 3:
        calls.append(engine.module.state_dict)  # gathers the shards
    out = []
    for call in calls:
        try:
            call()
            out.append("")
        except zeroshard.ZeroshardError as e:
            out.append(str(e) if "reload_states" in str(e) else f"other: {e}")
    return out


def _same_files(a: str, b: str) -> list[str]:
    """The files that differ between two checkpoint folders (their paths, or what is missing)."""

    def files(top: str) -> dict[str, bytes]:
        out = {}
        for folder, _, names in os.walk(top):
            for name in names:
                with open(os.path.join(folder, name), "rb") as f:
                    out[os.path.relpath(os.path.join(folder, name), top)] = f.read()
        return out

    first, second = files(a), files(b)
    if sorted(first) != sorted(second):
        return [f"paths: {sorted(first)} / {sorted(second)}"]
    for meta in (first, second):  # the metadata names its tag (and its checksum covers the name)
        fields = json.loads(meta.pop("metadata.json"))
        meta["metadata"] = repr({k: v for k, v in fields.items() if k not in ("tag", "metadata_crc32")}).encode()
    return sorted(path for path in first if first[path] != second[path])


def _visible(model, stage: int) -> list[torch.Tensor]:
    """What a script reads of the parameters without gathering: the parameters at stages 0-2, the persistent ones
    and each rank's part (`ds_tensor`) at stage 3."""
    if stage < 3:
        return [p.detach().clone() for p in model.parameters()]
    persistent = [p.detach().clone() for p in model.parameters() if p.ds_persist]
    return persistent + [p.ds_tensor.clone() for p in model.parameters()]


def _away(engine, kinds: tuple[str, ...]) -> bool:
    """Every tensor of `kinds` on the device holds no memory."""
    offloadable = engine.strategy.offloadable()
    return all(t.untyped_storage().nbytes() == 0 for k in kinds for t in offloadable[k] if t.device == engine.device)


def _round_trip(rank: int, world_size: int, folder: str):
    import zeroshard
    from zeroshard.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    rl = [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params, "contiguous_grad_buffer"]
    out = {}
    cases = [Case(stage=1, steps=4), Case(stage=2, steps=4), Case(stage=3, steps=4, persistence=2000)]
    cases.append(Case(stage=3, steps=3, dtype="bf16", micro=1, seq=8))  # bf16: masters of their own (hp_params)
    for case in cases:
        for variant in ("none", "all", "rl", "in_turn", "bad") if case.dtype == "fp32" else ("none", "all"):
            model = build_model(case)
            engine, _, _, _ = zeroshard.initialize(
                model=model, model_parameters=param_groups(model, case), config=ds_config(case)
            )
            losses, seen = [], {}
            for step, batch in enumerate(global_batches(case, world_size)):
                x, y = micro_batch(batch, 0, rank, world_size, case.micro)
                if step == 2 and variant != "none":
                    with torch.no_grad():
                        evaluated = engine(x, y).item()
                    before = engine.memory_report()
                    if variant == "all":
                        values = _visible(model, case.stage)
                        engine.offload_states()
                        during = engine.memory_report()
                        seen["away"] = _away(engine, ("optim_states", "hp_params", "lp_params", "lp_grads"))
                        seen["offloaded"] = sorted(engine.strategy.offloaded)
                        # the parameters (stage 3: the persistent ones and every ds_tensor) read the host copies
                        now = _visible(model, case.stage)
                        seen["host_views"] = all(torch.equal(a, b) for a, b in zip(values, now, strict=True))
                        if case.stage < 3:  # what a save reads
                            saved = engine.module_state_dict()
                            seen["saved"] = all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
                        seen["refused"] = _refusals(engine, folder, x, y)
                        # a save while offloaded (OpenRLHF saves after its offload): the states come back for it and
                        # move out again; the files equal a save made after reload_states() below
                        tag = f"{case.stage}-{case.dtype}"
                        engine.save_checkpoint(folder, f"away-{tag}")
                        kinds = ("optim_states", "hp_params", "lp_params", "lp_grads")
                        seen["away_after_save"] = _away(engine, kinds) and sorted(engine.strategy.offloaded)
                        seen["device"] = [getattr(during, c) for c in COLUMNS] + [during.comm_buffers]
                        seen["moved"] = sum(getattr(during, c) for c in HOST) - sum(getattr(before, c) for c in HOST)
                        seen["held"] = sum(getattr(before, c) for c in COLUMNS)
                    elif variant == "rl":  # OpenRLHF's set and call, through engine.optimizer: the model evaluates
                        engine.optimizer.offload_states(include=rl, device=OffloadDeviceEnum.cpu, non_blocking=True)
                        seen["away"] = _away(engine, ("optim_states", "hp_params"))
                        seen["offloaded"] = sorted(engine.strategy.offloaded)
                        with torch.no_grad():
                            seen["evaluated"] = engine(x, y).item() == evaluated
                        seen["refused"] = _refusals(engine, folder, x, y)[2:3]  # the step
                        try:  # the state's device storages are empty: read through the view, refused
                            engine.optimizer.state_dict()
                        except zeroshard.ZeroshardError as e:
                            seen["refused"].append(str(e))
                        if case.stage == 3:  # OpenRLHF's 16-bit save after its offload: works, the states stay out
                            whole = engine._consolidated_16bit_state_dict()
                            keys = sorted(model.state_dict()) if rank == 0 else None  # (gathers: every rank)
                            seen["consolidated"] = (sorted(whole) if whole is not None else None) == keys
                            with zeroshard.GatheredParameters([next(model.parameters())]):
                                try:  # the states could not move out again in here: refused before anything
                                    engine.save_checkpoint(folder, "inside")
                                except zeroshard.ZeroshardError as e:
                                    seen["inside"] = str(e)
                            seen["consolidated"] &= _away(engine, ("optim_states",))
                            seen["consolidated"] &= not os.path.exists(os.path.join(folder, "inside"))
                    elif variant == "in_turn":  # a second call moves what the first left, a third nothing
                        engine.offload_states(include=["optim_states"])
                        engine.offload_states(include=["hp_params", "lp_params"])
                        engine.offload_states(include=["optim_states"], pin_memory=False)
                        seen["offloaded"] = sorted(engine.strategy.offloaded)
                        seen["away"] = _away(engine, ("optim_states", "hp_params", "lp_params"))
                    else:  # one line naming what is wrong; nothing moved
                        for kwargs in ({"include": ["bogus"]}, {"device": "nvme"}):
                            try:
                                engine.offload_states(**kwargs)
                            except zeroshard.ZeroshardError as e:
                                seen.setdefault("errors", []).append(str(e))
                        engine.offload_states(device=OffloadDeviceEnum.none)
                        seen["offloaded"] = sorted(engine.strategy.offloaded)
                    (engine.optimizer if variant == "rl" else engine).reload_states()
                    if variant == "all":
                        engine.save_checkpoint(folder, f"back-{tag}")
                        seen["saved_alike"] = _same_files(
                            os.path.join(folder, f"away-{tag}"), os.path.join(folder, f"back-{tag}")
                        )
                    after = engine.memory_report()
                    seen["restored"] = [getattr(after, c) for c in COLUMNS] == [getattr(before, c) for c in COLUMNS]
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            if variant == "all":  # destroy() while offloaded brings the states back: the module is whole after it
                engine.offload_states()
                engine.destroy()
                seen["whole_after_destroy"] = all(p.numel() > 0 for p in model.parameters())
            else:
                engine.destroy()
            out[(case.stage if case.dtype == "fp32" else case.dtype, variant)] = (losses, seen)
    return out


def test_offload_states_by_kind_and_reload_continue_bit_identically(tmp_path):
    """Each kind DeepSpeed's `include` names moves (its device storages empty, its bytes in the memory report's host
    columns); the calls that would read empty storages refuse in one line (forwards too with the parameters away,
    stage 3's state_dict()); after reload_states() the run continues bit for bit."""
    for result in run_on_ranks(_round_trip, 2, str(tmp_path)):
        for stage in (1, 2, 3):
            plain = result[(stage, "none")][0]
            for variant in ("all", "rl", "in_turn", "bad"):
                losses, seen = result[(stage, variant)]
                assert losses == plain, (stage, variant, plain, losses)
                assert seen["restored"], (stage, variant)
            _, seen = result[(stage, "all")]
            # stage 3 (fp32): the master is the compute shard, which moves as lp_params; its gradient shards exist
            # from reduction to step only ([Note: gradient shards exist from reduction to step])
            kinds = ["hp_params", "lp_grads", "lp_params", "optim_states"]
            kinds = kinds if stage < 3 else ["lp_params", "optim_states"]
            assert seen["away"] and seen["offloaded"] == kinds, seen
            assert seen["host_views"] and seen.get("saved", True), seen
            assert all(message.endswith("call engine.reload_states() first") for message in seen["refused"]), seen
            assert "lp_params offloaded" in seen["refused"][0], seen["refused"][0]  # the forward names what is away
            assert seen["device"] == [0] * (len(COLUMNS) + 1), seen["device"]  # the device holds none of it now
            assert seen["moved"] == seen["held"] > 0, seen  # ... and the host all of it
            assert seen["whole_after_destroy"]
            assert seen["away_after_save"] == kinds and seen["saved_alike"] == [], seen
            _, seen = result[(stage, "rl")]
            assert seen["away"] and seen["evaluated"], seen
            assert seen["offloaded"] == (["hp_params", "optim_states"] if stage < 3 else ["optim_states"]), seen
            assert "reload_states" in seen["refused"][0], seen
            assert seen["refused"][1].startswith("engine.optimizer.state_dict: optim_states offloaded"), seen
            if stage == 3:
                assert seen["consolidated"] and "inside GatheredParameters" in seen["inside"], seen
            _, seen = result[(stage, "in_turn")]
            assert seen["away"] and seen["offloaded"] == (kinds[:1] + kinds[2:] if stage < 3 else kinds), seen
            _, seen = result[(stage, "bad")]
            assert seen["offloaded"] == [], seen
            assert "unknown state bogus" in seen["errors"][0] and "lp_params" in seen["errors"][0], seen
            assert "device='nvme'" in seen["errors"][1], seen
        losses, seen = result[("bf16", "all")]
        assert losses == result[("bf16", "none")][0] and seen["restored"] and seen["whole_after_destroy"], seen
        assert seen["away"] and seen["offloaded"] == ["hp_params", "lp_params", "optim_states"], seen
        assert seen["device"] == [0] * (len(COLUMNS) + 1) and seen["moved"] == seen["held"] > 0, seen


def _split_offloaded(rank: int, world_size: int) -> list[str]:
    """A split strategy (torch_autocast at stage 2: two flat parts, each the registered owner of its parameters)."""
    import torch
    from torch import nn

    import zeroshard
    from zeroshard import utils

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4, 4), nn.Linear(4, 4, bias=False))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.backward(engine(torch.tensor([1, 2])).sum())
    engine.step()
    weight = model[1].weight
    engine.offload_states(include=["optim_states", "hp_params"])
    refused = []
    for call in (
        lambda: utils.safe_get_full_fp32_param(weight),
        lambda: utils.safe_get_full_optimizer_state(weight, "exp_avg"),
        lambda: utils.safe_set_full_fp32_param(weight, torch.ones(4, 4)),
        lambda: zeroshard.GatheredParameters([weight], modifier_rank=0).__enter__(),
    ):
        try:
            call()
            refused.append("not refused")
        except zeroshard.ZeroshardError as e:
            refused.append(str(e).split(":")[0])
    values = [p.detach().clone() for p in model.parameters()]
    engine.offload_states(include=["lp_params"])
    # both parts' parameters read their host copies (their flat buffers hold no memory now)
    params = zip(model.parameters(), values, strict=True)
    hosts = [p.untyped_storage().nbytes() > 0 and torch.equal(p, v) for p, v in params]
    engine.reload_states()
    assert utils.safe_get_full_fp32_param(weight) is not None
    engine.destroy()
    return refused, hosts


def test_a_split_strategys_parts_refuse_while_offloaded():
    """The parameter registry names a split strategy's part as a parameter's owner: the parts know the states are
    offloaded too (before, the calls read and wrote empty storages), and both parts' parameters move to the host."""
    for refused, hosts in run_on_ranks(_split_offloaded, 2):
        assert refused == [
            "safe_get_full_fp32_param",
            "safe_get_full_optimizer_state",
            "safe_set_full_fp32_param",
            "GatheredParameters(modifier_rank=...)",
        ], refused
        assert hosts == [True, True], hosts
