"""The comms logger and the FLOPs profiler on 2 gloo ranks at stage 3: the logger's counts equal `comm_stats`,
the profile counts full parameters (not the empty shards), monitors exist on rank 0 only."""

from __future__ import annotations

import pathlib

from helpers.harness import run_on_ranks

K, N, OUT, MICRO = 8, 32, 4, 2
STEPS = 3


def _run(rank: int, world_size: int, out: str) -> dict:
    import torch
    from torch import nn

    import zeroshard
    from zeroshard.comm.api import log_summary

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, N, bias=False), nn.ReLU(), nn.Linear(N, OUT, bias=False))
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "comms_logger": {"enabled": True},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": f"{out}/flops.txt"},
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=cfg)
    engine.comms_logger.reset_data()  # count from here, as comm_stats does
    engine.comm_stats.reset()
    for _ in range(STEPS):
        loss = engine(torch.randn(MICRO, K)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    table = engine.comms_logger.log_all(print_log=False, return_dict=True)
    summary = log_summary(return_dict=True)
    calls = {k: v["calls"] for k, v in engine.comm_stats.snapshot().items()}
    monitors = len(engine.telemetry.monitors)
    with_stragglers = engine.comms_logger.log_all(print_log=False, show_straggler=True, return_dict=True)
    assert with_stragglers is not None
    stragglers = with_stragglers["straggler_analysis"]
    # an all-to-all of uneven sizes is logged at each rank's own size (Muon's exchange, MoE): the ranks' rows differ
    # and the straggler reductions, one per row, would pair different all-reduces; they are left out
    sends, receives = ([1, 1], [1, 2]) if rank == 0 else ([2, 1], [1, 1])
    engine.comm.all_to_all_uneven(torch.empty(sum(receives)), torch.ones(sum(sends)), receives, sends)
    uneven = engine.comms_logger.log_all(print_log=False, show_straggler=True, return_dict=True)
    engine.destroy()
    assert table is not None
    counts = {op: sum(row["count"] for row in sizes.values()) for op, sizes in table["summary"].items()}
    return {
        "counts": counts,
        "calls": calls,
        "monitors": monitors,
        "same": summary["summary"] == table["summary"],
        "stragglers": {op: sum(row["count"] for row in sizes.values()) for op, sizes in stragglers.items()},
        "uneven": uneven["straggler_analysis"] if uneven is not None else None,
    }


def test_comms_logger_counts_and_stage3_flops_profile(tmp_path: pathlib.Path) -> None:
    results = run_on_ranks(_run, 2, str(tmp_path))
    names = {
        "all_reduce": "all_reduce",
        "reduce_scatter": "reduce_scatter_tensor",
        "all_gather": "all_gather_into_tensor",
        "broadcast": "broadcast",
    }
    for r in results:
        assert r["calls"]["all_gather"] > 0 and r["calls"]["reduce_scatter"] > 0
        assert {names[k]: v for k, v in r["calls"].items() if v} == r["counts"]
        assert r["same"]
        assert r["stragglers"] == r["counts"]  # the minimum latency over ranks, per collective and size
        assert r["uneven"] == {}  # not computed (before: mismatched all-reduces, a hang on NCCL)
    assert [r["monitors"] for r in results] == [1, 0]
    profile = (tmp_path / "flops.txt").read_text()
    params = profile.split("params per GPU:")[1].splitlines()[0].strip()
    assert params == str(K * N + N * OUT)  # full shapes, though each rank holds half of them
    assert f"(0): Linear({K * N} = " in profile and f"{MICRO * K * N} MACs" in profile
    assert len((tmp_path / "csv" / "Train_Samples_lr.csv").read_text().splitlines()) == 1 + STEPS
