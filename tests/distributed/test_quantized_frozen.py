"""`zero_quantized_nontrainable_weights` ([Note: quantized frozen weights] in zero/stage3/packed.py): frozen weights
held as 8-bit blocks at stage 3. Parity: the engine against the single-process reference started from the engine's
(dequantized) frozen values, every step; the quantization error bound; bytes held; checkpoints."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from test_parity import TOL

from helpers.harness import run_on_ranks
from helpers.parity import (
    Case,
    build_model,
    ds_config,
    engine_run,
    param_groups,
    reference_run,
    relative_difference,
)

KEY = {"zero_quantized_nontrainable_weights": True}
CASES = [
    Case(stage=3, variant="mostly_frozen"),  # LoRA-like: the blocks' big matrices frozen
    Case(stage=3, variant="mostly_frozen", dtype="bf16", gas=3),
    Case(stage=3, variant="mostly_frozen", offload="cpu"),  # a separate host master; the codes stay with the shard
    Case(stage=3, variant="mostly_frozen", offload="cpu", offload_param="nvme"),  # the codes in the swap files
    # small frozen parameters in units that mostly train: the frozen section of their units is packed all the same
    Case(stage=3, variant="frozen"),
]
QUANTIZER_BYTES = 1 + 4 / 256  # per element: a code, and one fp32 scale per block of 256 ([Note: block quantization])


def _configure(zero: dict[str, Any]) -> Any:
    def configure(config: dict) -> dict:
        config["zero_optimization"].update(zero)
        return config

    return configure


def _frozen_values(engine: Any) -> dict[str, torch.Tensor]:
    """The frozen parameters' values as the engine computes with them (a gathering state_dict: collective)."""
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    return {n: v.float().clone() for n, v in engine.module.state_dict().items() if n in frozen}


def _shards(engine: Any) -> list[tuple[int, int, bool]]:
    """Per unit: its shard's elements, how many of them the shard keeps in the compute dtype by the rule ([Note:
    quantized frozen weights]: its chunk of the trainable section, on every rank), and whether the unit is packed."""
    out = []
    for u in engine.strategy.units:
        out.append((u.layout.shard_numel, u.layout.shard_numel - u.layout.frozen_width, u.tail is not None))
    return out


def _runs(rank: int, world_size: int) -> list[Any]:
    out = []
    for case in CASES:
        values: dict[str, torch.Tensor] = {}
        shards: list[Any] = []

        def capture(engine: Any, values: dict = values, shards: list = shards) -> None:
            engine.optimizer.quantize_nontrainable_params()  # DeepSpeed-Chat's call after initialize: a no-op here
            values.update(_frozen_values(engine))
            shards.extend(_shards(engine))

        result = engine_run(rank, world_size, case, _configure(KEY), capture)
        plain = engine_run(rank, world_size, case)
        out.append((result, values, plain[2], shards))
    return out


def _held(report: Any) -> int:
    return report.params + report.host_params + report.nvme_bytes  # no optimizer state on NVMe in these cases


def test_quantized_frozen_weights_train_as_the_reference_from_their_values() -> None:
    per_rank = run_on_ranks(_runs, 2, timeout=600)
    failures = []
    for i, case in enumerate(CASES):
        (losses, params, _), values, _, _ = per_rank[0][i]
        original = dict(build_model(case).named_parameters())
        # quantized: the frozen matrices moved, each by at most half a block's step (max |w| / 254) plus a rounding
        moved = 0
        for name, value in values.items():
            before = original[name].detach()
            bound = before.abs().max() / 254 * 1.01 + (2**-8 if case.dtype == "bf16" else 1e-7) * before.abs().max()
            assert (value - before).abs().max() <= bound, (case.name, name)
            moved += int(not torch.equal(value, before))
        assert moved > 0, (case.name, moved)
        ref_losses, ref_params = reference_run(case, 2, values=values) if case.master == "fp32" else ([], [])
        loss_tol, param_tol = TOL[case.dtype]
        for step in range(case.steps):
            loss = sum(per_rank[r][i][0][0][step] for r in range(2)) / 2
            if abs(loss - ref_losses[step]) > loss_tol * abs(ref_losses[step]):
                failures.append(f"{case.name} step {step}: loss {loss!r} vs {ref_losses[step]!r}")
            if relative_difference(params[step], ref_params[step]) > param_tol:
                failures.append(f"{case.name} step {step}: params differ")
        assert torch.equal(per_rank[1][i][0][1][-1], params[-1]), f"{case.name}: ranks disagree"
        # bytes of the compute shards on each rank: a packed unit's kept elements in the compute dtype, the rest at
        # QUANTIZER_BYTES instead of 4 (fp32) or 2 (bf16); other units' whole shards
        size = 2 if case.dtype == "bf16" else 4
        held = []
        for r in range(2):
            (_, _, report), _, plain_report, shards = per_rank[r][i]
            expected = sum(k * size + (n - k) * QUANTIZER_BYTES if packed else n * size for n, k, packed in shards)
            held.append(_held(report))
            assert expected <= held[r] <= 1.01 * expected, (case.name, r, held[r], expected)
            assert (held[r] < 0.7 * _held(plain_report)) == (case.variant == "mostly_frozen"), (case.name, r)
        # every rank keeps its chunk of the trainable section and packs its chunk of the frozen one: balanced, as
        # are the masters and optimizer state (the adapters are spread over the ranks, not all on the first)
        assert held[1] == held[0], (case.name, held)
        reports = [per_rank[r][i][0][2] for r in range(2)]
        masters = [r.master_weights + r.host_master_weights for r in reports]
        masters = [m + r.optimizer_state + r.host_optimizer_state for m, r in zip(masters, reports, strict=True)]
        assert masters[0] == masters[1] > 0, (case.name, masters)
    assert not failures, "\n".join(failures[:20])


def _checkpoint(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Saved with the key; loaded by an engine with it (the codes come back bit for bit, training continues as
    the uninterrupted run) and by one without it (the dequantized values). Both loading engines start from other
    frozen values, so only the load can give them the saved ones."""
    import zeroshard

    case = Case(stage=3, variant="mostly_frozen", steps=4)

    def engine_with(zero: dict[str, Any], moved: bool = False) -> Any:
        model = build_model(case)
        with torch.no_grad():
            for p in model.parameters():
                if moved and not p.requires_grad:
                    p.add_(0.5)
        config = ds_config(case)
        config["zero_optimization"].update(zero)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        return engine

    from helpers.parity import global_batches, micro_batch

    batches = global_batches(case, world_size)

    def train(engine: Any, steps: list[Any]) -> list[float]:
        losses = []
        for batch in steps:
            loss = engine(*micro_batch(batch, 0, rank, world_size, case.micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    first = engine_with(KEY)
    train(first, batches[:2])
    codes = [u.tail.codes.clone() for u in first.strategy.units if u.tail is not None]
    values = _frozen_values(first)
    first.save_checkpoint(root, tag="q")
    through = train(first, batches[2:])
    first.destroy()

    again = engine_with(KEY, moved=True)
    before = [u.tail.codes.clone() for u in again.strategy.units if u.tail is not None]
    again.load_checkpoint(root, tag="q")
    reloaded = [u.tail.codes.clone() for u in again.strategy.units if u.tail is not None]
    resumed = train(again, batches[2:])
    again.destroy()

    plain = engine_with({}, moved=True)
    plain.load_checkpoint(root, tag="q")
    plain_values = _frozen_values(plain)
    plain.destroy()
    return {
        "codes_equal": len(codes) > 0 and all(torch.equal(a, b) for a, b in zip(codes, reloaded, strict=True)),
        "codes_differed": any(not torch.equal(a, b) for a, b in zip(codes, before, strict=True)),
        "resumed": resumed == through,
        "plain_values": all(torch.equal(plain_values[n], values[n]) for n in values),
    }


def test_checkpoint_round_trip_keeps_the_codes() -> None:
    with tempfile.TemporaryDirectory() as root:
        for result in run_on_ranks(_checkpoint, 2, root, timeout=300):
            assert result == {"codes_equal": True, "codes_differed": True, "resumed": True, "plain_values": True}


def _zeropp(rank: int, world_size: int) -> dict[str, Any]:
    """With hpZ, a packed unit's secondary partition is its block of the forward gather's rows (codes, as DeepSpeed
    keeps it quantized) and backward unpacks the same bytes: the run is the key-alone run to the bit; with qwZ too
    the kept elements also travel as 8-bit blocks: close."""
    case = Case(stage=3, variant="mostly_frozen", dtype="bf16", steps=3)
    hpz = {"zero_hpz_partition_size": 2}
    alone = engine_run(rank, world_size, case, _configure(KEY))
    with_hpz = engine_run(rank, world_size, case, _configure({**KEY, **hpz}))
    both = engine_run(rank, world_size, case, _configure({**KEY, **hpz, "zero_quantized_weights": True}))
    unquantized = engine_run(rank, world_size, case, _configure(hpz))
    exact = alone[0] == with_hpz[0] and all(torch.equal(a, b) for a, b in zip(alone[1], with_hpz[1], strict=True))
    return {
        "hpz_exact": exact,
        "alone": alone[0],
        "both": both[0],
        "secondary": (with_hpz[2].secondary_params, unquantized[2].secondary_params),
    }


def test_composes_with_qwz_and_hpz() -> None:
    for result in run_on_ranks(_zeropp, 2, timeout=300):
        assert result["hpz_exact"], result
        # the blocks' secondaries at about a byte per frozen element instead of bf16's 2 (the root unit, unpacked,
        # and the blocks' kept adapters in bf16 make up the rest)
        packed, plain = result["secondary"]
        assert 0 < packed < 0.7 * plain, result["secondary"]
        for a, b in zip(result["both"], result["alone"], strict=True):
            assert abs(a - b) <= 0.02 * abs(b), result


def _one_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """At one rank the tail is quantized all the same (DeepSpeed dequantizes there too); the consolidated state dict
    gives the values the engine computes with; a 2-rank checkpoint loads here, its frozen values quantized again in
    this layout's blocks (within the bound of one more quantization)."""
    case = Case(stage=3, variant="mostly_frozen", steps=2)
    values: dict[str, torch.Tensor] = {}
    consolidated: dict[str, torch.Tensor] = {}

    def capture(engine: Any) -> None:
        values.update(_frozen_values(engine))
        consolidated.update(engine.consolidated_state_dict())

    losses, params, _ = engine_run(rank, world_size, case, _configure(KEY), capture)
    import zeroshard

    model = build_model(case)
    config = ds_config(case)
    config["zero_optimization"].update(KEY)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    engine.load_checkpoint(root, tag="q")
    resharded = _frozen_values(engine)
    engine.destroy()
    return {
        "losses": losses,
        "params": params,
        "values": values,
        "consolidated": all(torch.equal(consolidated[n], v) for n, v in values.items()),
        "resharded": resharded,
    }


def test_one_rank_consolidation_and_a_resharded_load() -> None:
    with tempfile.TemporaryDirectory() as root:
        saved = run_on_ranks(_checkpoint_values, 2, root, timeout=300)[0]
        (result,) = run_on_ranks(_one_rank, 1, root, timeout=300)
    case = Case(stage=3, variant="mostly_frozen", steps=2)
    assert result["consolidated"] and len(result["values"]) > 0
    ref_losses, ref_params = reference_run(case, 1, values=result["values"])
    for step in range(case.steps):
        assert abs(result["losses"][step] - ref_losses[step]) <= 1e-6 * abs(ref_losses[step])
        assert relative_difference(result["params"][step], ref_params[step]) <= 1e-6
    original = dict(build_model(case).named_parameters())
    assert any(not torch.equal(v, original[n].detach()) for n, v in result["values"].items())  # quantized at 1 rank
    for name, value in result["resharded"].items():
        before = original[name].detach()
        assert (value - before).abs().max() <= 2 * before.abs().max() / 254 * 1.01, name  # quantized twice
        assert (value - saved[name]).abs().max() <= saved[name].abs().max() / 254 * 1.01, name


def _checkpoint_values(rank: int, world_size: int, root: str) -> dict[str, torch.Tensor]:
    """A 2-rank checkpoint of an engine with the key, before any step; the frozen values it computed with."""
    import zeroshard

    case = Case(stage=3, variant="mostly_frozen")
    model = build_model(case)
    config = ds_config(case)
    config["zero_optimization"].update(KEY)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    values = _frozen_values(engine)
    engine.save_checkpoint(root, tag="q")
    engine.destroy()
    return values


def _hpz_groups(rank: int, world_size: int) -> bool:
    """4 ranks as 2 nodes x 2, hpZ within each node: two hpZ groups, each holding the rows of its own 2 ranks' blocks
    ([Note: quantized frozen weights]); backward from them must be the key-alone run to the bit."""
    import os

    os.environ["ZEROSHARD_RANKS_PER_NODE"] = "2"
    case = Case(stage=3, variant="mostly_frozen", dtype="bf16", steps=3)
    alone = engine_run(rank, world_size, case, _configure(KEY))
    grouped = engine_run(rank, world_size, case, _configure({**KEY, "zero_hpz_partition_size": 2}))
    return alone[0] == grouped[0] and all(torch.equal(a, b) for a, b in zip(alone[1], grouped[1], strict=True))


def test_hpz_in_two_groups_is_exact() -> None:
    assert all(run_on_ranks(_hpz_groups, 4, timeout=300))
