"""The fsdp2 backend (`"zeroshard": {"backend": "fsdp2"}`) against the single-process reference, every step, and
against the zero backend; the engine API on it (docs/fsdp2.md)."""

from __future__ import annotations

import pytest
import torch

from helpers.harness import run_on_ranks
from helpers.parity import (
    Case,
    build_model,
    ds_config,
    engine_run,
    global_batches,
    micro_batch,
    param_groups,
    reference_run,
    relative_difference,
)

FP32_TOL = 1e-6
BF16_TOL = 1e-2  # [Note: bf16 tolerance] in test_parity.py

CASES = [Case(stage=3), Case(stage=3, gas=3), Case(stage=2), Case(stage=2, gas=3)]  # the first also on zero
VARIANTS = [
    Case(stage=3, variant="frozen"),
    Case(stage=2, variant="unused"),
    Case(stage=3, variant="eval"),
    Case(stage=3, dtype="bf16", gas=2),
    Case(stage=3, dtype="bf16", variant="mostly_frozen", steps=4),  # frozen weights kept in bf16
]


def fsdp2(config: dict) -> dict:
    return {**config, "zeroshard": {"backend": "fsdp2"}}


def _both_backends(rank: int, world_size: int, cases: list[Case]):
    """Each case on the fsdp2 backend; the first also on the zero backend (the per-step loss comparison)."""
    fsdp = [engine_run(rank, world_size, case, fsdp2)[:2] for case in cases]
    zero = engine_run(rank, world_size, cases[0])[:2]
    return fsdp, zero


def _fsdp2_only(rank: int, world_size: int, cases: list[Case]):
    return [engine_run(rank, world_size, case, fsdp2)[:2] for case in cases], None


def _mean_losses(per_rank: list, i: int, world_size: int) -> list[float]:
    steps = len(per_rank[0][i][0])
    return [sum(per_rank[r][i][0][s] for r in range(world_size)) / world_size for s in range(steps)]


def _parity_failures(cases: list[Case], fsdp: list, world_size: int, fp32_tol: float = FP32_TOL) -> list[str]:
    failures = []
    for i, case in enumerate(cases):
        tol = fp32_tol if case.dtype == "fp32" else BF16_TOL
        ref_losses, ref_params = reference_run(case, world_size)
        for step, loss in enumerate(_mean_losses(fsdp, i, world_size)):
            rel = abs(loss - ref_losses[step]) / abs(ref_losses[step])
            if rel > tol:
                failures.append(f"fsdp2 {case.name} step {step}: loss {loss!r} vs {ref_losses[step]!r} ({rel:.2e})")
            for r in range(world_size):
                p_rel = relative_difference(fsdp[r][i][1][step], ref_params[step])
                if p_rel > tol:
                    failures.append(f"fsdp2 {case.name} step {step} rank {r}: params rel diff {p_rel:.2e}")
        if not torch.equal(fsdp[0][i][1][-1], fsdp[1][i][1][-1]):
            failures.append(f"{case.name}: ranks disagree")
    return failures


def test_fsdp2_parity_stages_2_3_with_accumulation_and_clipping():
    """fp32, 1e-6 relative every step against the single-process reference; stage 3 also against the zero backend."""
    world_size = 2
    results = run_on_ranks(_both_backends, world_size, CASES)
    fsdp = [r[0] for r in results]
    failures = _parity_failures(CASES, fsdp, world_size)
    zero = [[r[1]] for r in results]
    pairs = zip(_mean_losses(fsdp, 0, world_size), _mean_losses(zero, 0, world_size), strict=True)
    for step, (a, b) in enumerate(pairs):
        if abs(a - b) / abs(b) > FP32_TOL:
            failures.append(f"zero vs fsdp2 {CASES[0].name} step {step}: {a!r} vs {b!r}")
    assert not failures, "\n".join(failures[:20])


def test_fsdp2_parity_three_ranks_uneven_shards():
    """3 ranks: FSDP2 splits 32- and 16-row parameters 11/11/10 and 6/6/4 (padded shards, a short last one)."""
    case = Case(stage=3, gas=2, steps=6)
    results = run_on_ranks(_fsdp2_only, 3, [case])
    # 1/3 is inexact in binary: the zero backend is 1.9e-6 from the reference at 3 ranks on this case too
    failures = _parity_failures([case], [r[0] for r in results], 3, fp32_tol=4e-6)
    assert not failures, "\n".join(failures[:20])


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by fsdp2 parity:
# test_fsdp2_parity_stages_2_3_with_accumulation_and_clipping
@pytest.mark.slow
def test_fsdp2_parity_frozen_unused_eval_bf16():
    results = run_on_ranks(_fsdp2_only, 2, VARIANTS)
    failures = _parity_failures(VARIANTS, [r[0] for r in results], 2)
    assert not failures, "\n".join(failures[:20])


def _api(rank: int, world_size: int, out_dir: str):
    import zeroshard
    from zeroshard.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
    )

    case = Case(stage=3, steps=2)
    model = build_model(case)
    config = fsdp2(ds_config(case))
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
    x, y = micro_batch(global_batches(case, world_size)[0], 0, rank, world_size, case.micro)
    before = engine.comm_stats.snapshot()
    engine.backward(engine(x, y))
    weight = engine.module.blocks[0].mlp[0].weight
    grad = safe_get_full_grad(weight)
    engine.step()
    stats = engine.comm_stats.snapshot()
    out: dict = {"grad_shape": tuple(grad.shape), "comm": (before, stats)}
    out["fp32"] = safe_get_full_fp32_param(weight)
    out["exp_avg"] = safe_get_full_optimizer_state(weight, "exp_avg")
    with pytest.raises(zeroshard.ZeroshardError, match="no_sync"), engine.no_sync():
        pass
    # GatheredParameters: rank 0 changes a weight (read from the module inside the block: FSDP2 registers the
    # gathered tensor there); every rank sees it afterwards, also in the shards
    with zeroshard.GatheredParameters(engine.module.blocks[1].attn.proj.weight, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                engine.module.blocks[1].attn.proj.weight.fill_(0.5)
    out["modified"] = bool((engine.consolidated_state_dict()["blocks.1.attn.proj.weight"] == 0.5).all())
    safe_set_full_fp32_param(weight, torch.full(tuple(weight.shape), 0.25))
    out["set"] = bool((engine.consolidated_state_dict()["blocks.0.mlp.0.weight"] == 0.25).all())
    with engine.gathered_for_generation(), torch.no_grad():
        bytes_before = engine.comm_stats.total_bus_bytes
        engine(x, y)
        engine(x, y)
        out["generation_bytes"] = engine.comm_stats.total_bus_bytes - bytes_before
        out["gathered_shapes"] = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
    engine.save_16bit_model(out_dir, "model.safetensors")
    out["consolidated"] = engine.consolidated_state_dict()
    out["report"] = engine.memory_report()
    # training goes on after all of the above
    engine.backward(engine(x, y))
    engine.step()
    engine.destroy()
    return out


def test_fsdp2_engine_api(tmp_path):
    from safetensors.torch import load_file

    results = run_on_ranks(_api, 2, str(tmp_path))
    reference = build_model(Case(stage=3))
    shapes = {n: tuple(p.shape) for n, p in reference.named_parameters()}
    for out in results:
        assert out["modified"], "GatheredParameters(modifier_rank=0) change lost"
        assert out["set"], "safe_set_full_fp32_param lost"
        assert out["generation_bytes"] == 0
        assert out["gathered_shapes"] == shapes
        assert out["grad_shape"] == shapes["blocks.0.mlp.0.weight"]
        assert torch.equal(out["fp32"], results[0]["fp32"]) and torch.equal(out["exp_avg"], results[0]["exp_avg"])
        before, after = out["comm"]
        assert after["all_gather"]["payload_bytes"] > before.get("all_gather", {}).get("payload_bytes", 0)
        assert after["reduce_scatter"]["payload_bytes"] > 0
        report = out["report"]
        psi = report.trainable_numel
        assert psi == sum(p.numel() for p in reference.parameters())
        # fp32 AdamW: 4 (params = masters) + 8 (moments) bytes per parameter, sharded over 2; FSDP2 frees the
        # gradients at the step (the zero backend keeps its gradient shards allocated)
        states = report.params + report.gradients + report.optimizer_state
        assert report.gradients == 0 and abs(states - 12 * psi / 2) <= 0.05 * 12 * psi / 2, report
    saved = load_file(str(tmp_path / "model.safetensors"))
    consolidated = results[0]["consolidated"]
    for name, tensor in saved.items():
        assert torch.equal(tensor, consolidated[name]), name


def test_fsdp2_fp16_loss_scaling_matches_zero_backend():
    """fp16 through zeroshard's loss scaler on both backends: the same skipped steps, losses within fp16 noise."""

    results = run_on_ranks(_fp16, 2)
    for fsdp_losses, zero_losses, fsdp_skipped, zero_skipped in results:
        assert fsdp_skipped == zero_skipped and fsdp_skipped > 0
        for a, b in zip(fsdp_losses, zero_losses, strict=True):
            assert abs(a - b) / abs(b) < 2e-2, (fsdp_losses, zero_losses)


def _fp16_config(config: dict) -> dict:
    config = {**config, "fp16": {"enabled": True, "initial_scale_power": 32}}  # starts by overflowing
    config.pop("bf16")
    return config


def _fp16(rank: int, world_size: int):
    import zeroshard

    out = []
    for backend in ("fsdp2", "zero"):
        case = Case(stage=3, steps=6)
        model = build_model(case)
        config = _fp16_config(ds_config(case))
        groups = param_groups(model, case)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=groups, config=config, backend=backend)
        losses = []
        for batch in global_batches(case, world_size):
            loss = engine(*micro_batch(batch, 0, rank, world_size, case.micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out.append((losses, engine.skipped_steps))
        engine.destroy()
    return out[0][0], out[1][0], out[0][1], out[1][1]


def test_fsdp2_single_process():
    """World size 1 (`python train.py`): FSDP2 on a one-rank mesh matches the reference."""
    case = Case(stage=3, gas=2)
    losses, params = run_on_ranks(_one_case, 1, case)[0]
    ref_losses, ref_params = reference_run(case, 1)
    for step in range(case.steps):
        assert abs(losses[step] - ref_losses[step]) / abs(ref_losses[step]) <= FP32_TOL
        assert relative_difference(params[step], ref_params[step]) <= FP32_TOL


def _one_case(rank: int, world_size: int, case: Case):
    return engine_run(rank, world_size, case, fsdp2)[:2]


def fsdp2_cpu_offload(config: dict) -> dict:
    config = fsdp2(config)
    for key in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][key]["device"] = "cpu"
    return config


def _offloaded(rank: int, world_size: int, case: Case):
    return engine_run(rank, world_size, case, fsdp2_cpu_offload)


def test_fsdp2_cpu_offload_parity():
    """offload_param + offload_optimizer on "cpu" -> CPUOffloadPolicy: the same training, state in host columns."""
    case = Case(stage=3, gas=2)
    results = run_on_ranks(_offloaded, 2, case)
    ref_losses, ref_params = reference_run(case, 2)
    mean_losses = [sum(r[0][step] for r in results) / 2 for step in range(case.steps)]
    for step, loss in enumerate(mean_losses):
        assert abs(loss - ref_losses[step]) / abs(ref_losses[step]) <= FP32_TOL, step
    for _, params, report in results:
        for step in range(case.steps):
            assert relative_difference(params[step], ref_params[step]) <= FP32_TOL, step
        assert report.host_master_weights > 0 and report.host_optimizer_state > 0
        assert report.params == report.optimizer_state == 0


def _refusals(rank: int, world_size: int) -> list[str]:
    import zeroshard

    messages = []
    for stage, zero, with_optimizer in (
        (1, {}, True),
        (0, {}, False),
        (3, {"offload_optimizer": {"device": "cpu"}}, True),
        (2, {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, True),
    ):
        config = fsdp2(ds_config(Case(stage=stage)))
        config["zero_optimization"] = {"stage": stage, **zero}
        if not with_optimizer:
            config.pop("optimizer")
        with pytest.raises(zeroshard.ConfigError) as err:
            zeroshard.initialize(model=build_model(Case(stage=stage)), config=config)
        messages.append(str(err.value))
    return messages


def test_unsupported_combinations_are_refused_by_name():
    stage1, stage0, offload, nvme = run_on_ranks(_refusals, 1)[0]
    assert "stage 2" in stage1 and '"zero" backend' in stage1 and "is 1" in stage1
    assert "is 0" in stage0  # refused also without an optimizer
    assert "zero_optimization.offload_param.device" in offload and "offload_optimizer.device" in offload
    assert "NVMe" in nvme


def _frozen_dtypes(rank: int, world_size: int) -> list[tuple[bool, str]]:
    import zeroshard

    case = Case(stage=3, dtype="bf16", variant="mostly_frozen", steps=1)
    model = build_model(case)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=param_groups(model, case), config=fsdp2(ds_config(case))
    )
    out = sorted({(p.requires_grad, str(p.to_local().dtype)) for p in model.parameters()})
    engine.destroy()
    return out


def test_frozen_parameters_are_sharded_in_the_compute_dtype():
    """The trainable parameters are the fp32 masters; a frozen one (a LoRA base) keeps only its bf16 shard, as on
    the zero backend ([Note: frozen parameters at stage 3])."""
    for got in run_on_ranks(_frozen_dtypes, 2):
        assert got == [(False, "torch.bfloat16"), (True, "torch.float32")], got
