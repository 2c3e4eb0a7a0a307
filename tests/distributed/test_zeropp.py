"""ZeRO++ on 4 gloo ranks acting as 2 nodes x 2 ([Note: nodes]): bytes per scope, secondary memory, loss closeness,
checkpoints across ZeRO++ on/off. Each claim is read from one counter of `engine.comm_stats` ([Note: scopes])."""

from __future__ import annotations

import os
from typing import Any

import pytest

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, global_batches, micro_batch, param_groups

WORLD = 4
PER_NODE = 2
ALL_THREE = {"zero_quantized_weights": True, "zero_hpz_partition_size": PER_NODE, "zero_quantized_gradients": True}


def _engine(case: Case, zeropp: dict[str, Any], per_node: int = PER_NODE) -> Any:
    import zeroshard

    os.environ["ZEROSHARD_RANKS_PER_NODE"] = str(per_node)
    model = build_model(case)
    cfg = ds_config(case)
    cfg["zero_optimization"].update(zeropp)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=cfg)
    return engine


def _bytes(engine: Any) -> dict[str, dict[str, float]]:
    """Bus bytes so far: {scope: {kind: bytes}}."""
    return {s: {k: v["bus_bytes"] for k, v in kinds.items()} for s, kinds in engine.comm_stats.scope_snapshot().items()}


def _minus(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {s: {k: after[s][k] - before[s][k] for k in after[s]} for s in after}


def _phases(rank: int, world_size: int, case: Case, zeropp: dict[str, Any]) -> dict[str, Any]:
    """Per-step losses and the bytes of each phase (forward, backward), summed over the steps."""
    engine = _engine(case, zeropp)
    forward: dict[str, dict[str, float]] = {}
    backward: dict[str, dict[str, float]] = {}
    losses = []
    for batch in global_batches(case, world_size):
        x, y = micro_batch(batch, 0, rank, world_size, case.micro)
        start = _bytes(engine)
        loss = engine(x, y)
        mid = _bytes(engine)
        engine.backward(loss)
        end = _bytes(engine)
        engine.step()
        losses.append(loss.item())
        for total, delta in ((forward, _minus(mid, start)), (backward, _minus(end, mid))):
            for s, kinds in delta.items():
                for k, v in kinds.items():
                    total.setdefault(s, {}).setdefault(k, 0.0)
                    total[s][k] += v
    report = engine.memory_report()
    secondary_expected = sum(
        u.numel // PER_NODE * u.full.element_size() for u in engine.strategy.units if not u.persistent
    )
    engine.destroy()
    return {
        "losses": losses,
        "forward": forward,
        "backward": backward,
        "secondary": report.secondary_params,
        "secondary_expected": secondary_expected,
        "params": report.params,
    }


def _byte_grid(rank: int, world_size: int, dtype: str) -> dict[str, Any]:
    case = Case(stage=3, dtype=dtype, steps=3)
    return {
        name: _phases(rank, world_size, case, zeropp)
        for name, zeropp in {
            "off": {},
            "qwZ": {"zero_quantized_weights": True},
            "hpZ": {"zero_hpz_partition_size": PER_NODE},
            "qgZ": {"zero_quantized_gradients": True},
            "all": ALL_THREE,
        }.items()
    }


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])  # CI budget
def test_zeropp_bytes_per_scope_and_secondary_memory(dtype: str) -> None:
    for result in run_on_ranks(_byte_grid, WORLD, dtype, timeout=300):
        off, qwz, hpz, qgz, both = (result[k] for k in ("off", "qwZ", "hpZ", "qgZ", "all"))
        inter, intra = "inter_node", "intra_node"
        # (a) qwZ: the forward weight gathers send int8 codes + fp32 block scales, 1 + 4/256 bytes per element
        fwd_fp32 = off["forward"][inter]["all_gather"] * (4 / 2 if dtype == "bf16" else 1)
        assert fwd_fp32 > 0 and qwz["forward"][inter]["all_gather"] <= 0.26 * fwd_fp32, (qwz["forward"], fwd_fp32)
        # (b) hpZ: no backward gather byte leaves the node; the extra memory is the secondary shard (1/2 per unit)
        assert off["backward"][inter]["all_gather"] > 0
        for run in (hpz, both):
            assert run["backward"][inter]["all_gather"] == 0, run["backward"]
            assert run["backward"][intra]["all_gather"] > 0
            assert run["secondary"] == run["secondary_expected"] > 0
        assert off["secondary"] == 0 and hpz["params"] == off["params"]
        # ... and counting prefetches for backward issued while forward runs: over a whole step, only the first
        # (forward) gather of each unit crosses nodes, half of ZeRO-3's two gathers
        step_off = off["forward"][inter]["all_gather"] + off["backward"][inter]["all_gather"]
        step_hpz = hpz["forward"][inter]["all_gather"] + hpz["backward"][inter]["all_gather"]
        assert abs(step_hpz - step_off / 2) <= 1e-9 * step_off, (step_hpz, step_off)
        # (c) qgZ: gradient bytes between nodes (the reduction's all-to-all hop 2) against fp32/bf16 reduce-scatter
        rs_off = off["backward"][inter]["reduce_scatter"]
        for run in (qgz, both):
            grad_inter = run["backward"][inter]["reduce_scatter"] + run["backward"][inter]["all_to_all"]
            assert rs_off > 0 and grad_inter <= 0.3 * rs_off, (run["backward"], rs_off)
            assert run["backward"][intra]["all_to_all"] > 0
        # all four runs train: close to the unquantized losses (short run; the long one is test_zeropp_loss_closeness)
        for run in (qwz, hpz, qgz, both):
            for a, b in zip(run["losses"], off["losses"], strict=True):
                assert abs(a - b) <= 0.02 * abs(b), (run["losses"], off["losses"])
        assert hpz["losses"] == off["losses"]  # hpZ moves the same values over a different group: exact


def _losses(rank: int, world_size: int, steps: int, every: int) -> dict[str, list[float]]:
    """The mean loss over ranks every `every` steps, unquantized and with all three features."""
    import torch
    import torch.distributed as dist

    case = Case(stage=3, dtype="bf16", steps=steps, lr=3e-3)
    out: dict[str, list[float]] = {}
    for name, zeropp in (("off", {}), ("all", ALL_THREE)):
        engine = _engine(case, zeropp)
        kept = []
        for step, batch in enumerate(_learnable_batches(case, world_size)):
            x, y = micro_batch(batch, 0, rank, world_size, case.micro)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if (step + 1) % every == 0:
                mean = loss.detach().float().clone()
                dist.all_reduce(mean)
                kept.append(float(mean) / world_size)
        engine.destroy()
        out[name] = kept
    del torch
    return out


def _learnable_batches(case: Case, world_size: int) -> list[tuple[Any, Any]]:
    """Each token a fixed function of the previous one, or (30% of the time) uniformly random: the loss falls as the
    model learns the function, to a floor near 1.9 nats, so a 2% band stays meaningful to the end."""
    import torch

    from helpers.parity import TINY

    g = torch.Generator().manual_seed(7)
    table = torch.randperm(TINY.vocab_size, generator=g)
    size = case.micro * world_size
    out = []
    for _ in range(case.steps):
        first = torch.randint(0, TINY.vocab_size, (size, 1), generator=g)
        seq = [first]
        for _ in range(case.seq):
            noise = torch.randint(0, TINY.vocab_size, (size, 1), generator=g)
            seq.append(torch.where(torch.rand(size, 1, generator=g) < 0.3, noise, table[seq[-1]]))
        tokens = torch.cat(seq, dim=1)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _assert_close(results: list[dict[str, list[float]]]) -> None:
    off, on = results[0]["off"], results[0]["all"]
    assert off[-1] < 0.8 * off[0], off  # it learned
    for a, b in zip(on, off, strict=True):
        assert abs(a - b) <= 0.02 * b, (on, off)


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by
# test_zeropp_bytes_per_scope_and_secondary_memory (qwZ, hpZ, qgZ and all three train within 2% of ZeRO-3, hpZ exactly)
@pytest.mark.slow
def test_zeropp_loss_closeness_short() -> None:
    """(d), the default-suite size: 40 steps, every 10th loss within 2% of the unquantized run's."""
    _assert_close(run_on_ranks(_losses, WORLD, 40, 10, timeout=300))


@pytest.mark.slow
def test_zeropp_loss_closeness_200_steps() -> None:
    """(d) as the issue states it: 200 steps, every 20th loss within 2% of the unquantized run's."""
    _assert_close(run_on_ranks(_losses, WORLD, 200, 20, timeout=1200))


def _checkpoints(rank: int, world_size: int, root: str) -> list[bool]:
    """Saved with ZeRO++ on, loaded with it off, and the other way round: the same fp32 masters come back; and
    state_dict under qwZ holds exact values."""
    import torch

    case = Case(stage=3, steps=2)
    same = []
    for save_with, load_with in ((ALL_THREE, {}), ({}, ALL_THREE)):
        engine = _engine(case, save_with)
        for batch in global_batches(case, world_size):
            x, y = micro_batch(batch, 0, rank, world_size, case.micro)
            engine.backward(engine(x, y))
            engine.step()
        if save_with:  # a pinned gather (state_dict) returns the exact values under qwZ, never the quantized ones
            state = engine.module.state_dict()
            named = engine.module.named_parameters()
            same.append(all(torch.equal(state[n], engine.strategy.full_fp32_param(p)) for n, p in named if n in state))
        path = os.path.join(root, "on" if save_with else "off")
        engine.save_checkpoint(path, tag="t")
        masters = [u.master.clone() for u in engine.strategy.units]
        engine.destroy()
        other = _engine(case, load_with)
        other.load_checkpoint(path, tag="t")
        same.append(all(torch.equal(a, u.master) for a, u in zip(masters, other.strategy.units, strict=True)))
        x, y = micro_batch(global_batches(case, world_size)[0], 0, rank, world_size, case.micro)
        other.backward(other(x, y))  # it trains on
        other.step()
        other.destroy()
    return same


def test_zeropp_checkpoints_load_with_it_off_and_on(tmp_path: Any) -> None:
    for same in run_on_ranks(_checkpoints, WORLD, str(tmp_path), timeout=300):
        assert same == [True, True, True]


def _feature_grid(rank: int, world_size: int) -> list[tuple[str, list[float], list[float]]]:
    """ZeRO++ with the other stage-3 features (accumulation, a persistent unit, offload, kept units), hpZ across
    nodes, and other node shapes: one node of 4 (qgZ's second hop has no peer), 4 nodes of 1 (its first has none)."""
    cases = [
        (Case(stage=3, gas=2, persistence=2000, steps=3), ALL_THREE, PER_NODE),
        (Case(stage=3, dtype="bf16", offload="cpu", offload_param="cpu", steps=3), ALL_THREE, PER_NODE),
        (Case(stage=3, reuse=10**9, prefetch=10**9, steps=3), ALL_THREE, PER_NODE),
        (Case(stage=3, dtype="bf16", gas=3, steps=3), {"zero_quantized_gradients": True}, PER_NODE),
        (Case(stage=3, steps=3), {"zero_hpz_partition_size": WORLD, "zero_quantized_weights": True}, PER_NODE),
        (Case(stage=3, steps=2), {**ALL_THREE, "zero_hpz_partition_size": WORLD}, WORLD),
        (Case(stage=3, steps=2), {"zero_quantized_gradients": True}, 1),
        (Case(stage=3, variant="mostly_frozen", steps=3), ALL_THREE, PER_NODE),  # qgZ of the trainable sections
    ]
    out = []
    for case, zeropp, per_node in cases:
        losses = []
        for extra in ({}, zeropp):
            engine = _engine(case, extra, per_node)
            run = []
            for batch in global_batches(case, world_size):
                step_loss = 0.0
                for k in range(case.gas):
                    x, y = micro_batch(batch, k, rank, world_size, case.micro)
                    loss = engine(x, y)
                    engine.backward(loss)
                    engine.step()
                    step_loss += loss.item() / case.gas
                run.append(step_loss)
            engine.destroy()
            losses.append(run)
        out.append((case.name, losses[0], losses[1]))
    return out


@pytest.mark.slow  # CI budget: ZeRO++ combined with the other stage-3 options
def test_zeropp_with_other_stage3_features() -> None:
    for rank_result in run_on_ranks(_feature_grid, WORLD, timeout=300):
        for name, off, on in rank_result:
            for a, b in zip(on, off, strict=True):
                assert abs(a - b) <= 0.02 * b, (name, on, off)
