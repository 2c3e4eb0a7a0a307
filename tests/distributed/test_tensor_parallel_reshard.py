"""[Note: tensor-parallel resharding] end to end, Adam moments and fp32 master weights included: a checkpoint of
tp2 x dp2 (4 gloo ranks, ZeRO-2) loaded into tp1 x dp2 (2 ranks, no tensor_parallel block, ZeRO-1), and one of
tp1 x dp2 (ZeRO-0) loaded into tp2 x dp2 (ZeRO-2), continue training with the per-step losses of the run that saved
them uninterrupted (fp32, 1e-6 relative): a slice concatenated or split along the wrong dimension, or optimizer
state not carried over, changes the first or the second step after the load far beyond that."""

from __future__ import annotations

import math
from typing import Any

import pytest

from helpers.harness import run_on_ranks
from helpers.tp_parity import TpCase, continue_from, resume

SAVE_AT = 1
TP2 = TpCase(stage=2, steps=3)  # saved at tp2, continued at tp1 with ZeRO-1
TP1 = TpCase(stage=0, steps=3)  # saved at tp1, continued at tp2 with ZeRO-2


def _tp2(rank: int, world_size: int, save_dir: str, tp1_dir: str) -> dict[str, Any]:
    """tp2 x dp2: train, save, resume (exactly, in tp2); and continue from the tp1 checkpoint."""
    from zeroshard.comm.topology import init_distributed

    init_distributed()
    out = resume(rank, TP2, save_dir, SAVE_AT)
    out["from_tp1"] = continue_from(rank, TpCase(stage=2, steps=TP1.steps), tp1_dir, SAVE_AT, tp=2)
    return out


def _tp1(rank: int, world_size: int, save_dir: str, tp2_dir: str | None) -> dict[str, Any]:
    """tp1 x dp2: train, save, resume; or continue from the tp2 checkpoint."""
    from zeroshard.comm.topology import init_distributed

    init_distributed()
    if tp2_dir is not None:
        return {"from_tp2": continue_from(rank, TpCase(stage=1, steps=TP2.steps), tp2_dir, SAVE_AT, tp=1)}
    return resume(rank, TP1, save_dir, SAVE_AT, tp=1)


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(math.isclose(g, w, rel_tol=1e-6) for g, w in zip(got, want, strict=True))


@pytest.mark.slow  # default-suite budget: moved 2026-11-25 (seventeenth session)
def test_checkpoints_reshard_across_tp_sizes(tmp_path) -> None:
    tp2_dir, tp1_dir = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    on_two = run_on_ranks(_tp1, 2, tp1_dir, None)
    on_four = run_on_ranks(_tp2, 4, tp2_dir, tp1_dir)
    back_on_two = run_on_ranks(_tp1, 2, tp1_dir, tp2_dir)
    for rank, got in enumerate(on_four):  # tp2 ranks 2r and 2r + 1 are replica r, as tp1 rank r is
        want = on_two[rank // 2]["straight"][SAVE_AT:]
        assert _close(got["from_tp1"], want), (rank, got["from_tp1"], want)
        assert got["resumed"] == got["straight"][SAVE_AT:], rank  # tp2 into tp2: exact
    for rank, got in enumerate(back_on_two):
        want = on_four[2 * rank]["straight"][SAVE_AT:]
        assert _close(got["from_tp2"], want), (rank, got["from_tp2"], want)
        assert on_two[rank]["resumed"] == on_two[rank]["straight"][SAVE_AT:], rank  # tp1 into tp1: exact
