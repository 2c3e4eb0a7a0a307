"""3D parallelism (pp2 x tp2 x dp2 on 8 gloo ranks): a PipelineModule whose blocks are Megatron-style column- then
row-parallel linear pairs over a fake mpu's tensor-parallel groups, ZeRO stage 1 over its data-parallel groups,
gradient clipping active every step (1F1B and interleaved 1F1B fed by data_iter, GPipe by the engine's loader over
training_data, its PipelineModule split by zeroshard.pipe's PipeModelDataParallelTopology; and, with SGD, 1F1B with
the input projection tied to the output layer across the stages, as Megatron-DeepSpeed's GPT); every rank's loss
equals a single-process reference (the same full weights, the same global batch, torch AdamW) within 1e-5 relative
at every step and in an eval_batch after the last. Then, in the same spawn, initialize
refuses an mpu whose pipeline size is not num_stages, and one whose groups are not laid out as DeepSpeed's
PipeModelDataParallelTopology ([Note: 3D mesh] in pipe/three_d.py) and autotp_size with a PipelineModule; a 3D
checkpoint resumes with the losses of the uninterrupted run exactly, and a pp2 x dp4 engine refuses to load it.
The model, mpu, data and reference are in helpers/three_d.py (test_pipeline_reshard.py loads this mesh's checkpoint
into pp2 x tp2 x dp1).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from helpers.harness import run_on_ranks
from helpers.three_d import DP, PP, SGD, STEPS, TP, FakeMpu, batches, build_engine, reference

RTOL = 1e-5


def _train(rank: int, world_size: int, schedules: list[str], save_dir: str) -> dict[str, Any]:
    from zeroshard.comm.topology import init_distributed
    from zeroshard.errors import ConfigError

    init_distributed()  # the mpu's groups come first, as Megatron's initialize_model_parallel
    out: dict[str, Any] = {}
    for schedule in schedules:
        engine = build_engine(rank, FakeMpu(rank), schedule)
        assert engine.dp_world_size == DP, engine.dp_world_size
        d = engine.pipe.data_parallel_rank
        it = iter([mb for step in batches() for mb in step[d]])
        out[schedule] = [float(engine.train_batch(data_iter=it if schedule != "gpipe" else None)) for _ in range(STEPS)]
        out[schedule].append(float(engine.eval_batch(data_iter=iter(batches()[0][d]))))
        engine.destroy()
    engine = build_engine(rank, FakeMpu(rank), "1f1b", SGD, tied=True)  # [Note: tied copies in the norm]
    it = iter([mb for step in batches() for mb in step[engine.pipe.data_parallel_rank]])
    out["tied"] = [float(engine.train_batch(data_iter=it)) for _ in range(STEPS)]
    engine.destroy()
    out.update(_resume(rank, save_dir))
    for name, mpu in (("pipe", FakeMpu(rank, pipe=4)), ("layout", FakeMpu(rank, tp_stride=DP))):
        try:
            build_engine(rank, mpu, "1f1b")
            out[name] = "accepted"
        except ConfigError as e:
            out[name] = str(e)
    try:
        build_engine(rank, FakeMpu(rank), "1f1b", {"tensor_parallel": {"autotp_size": TP}}, mpu_given=False)
        out["autotp"] = "accepted"
    except ConfigError as e:
        out["autotp"] = str(e)
    return out


def _steps(engine: Any, steps: list[list[list[tuple[torch.Tensor, torch.Tensor]]]]) -> list[float]:
    d = engine.pipe.data_parallel_rank
    it = iter([mb for step in steps for mb in step[d]])
    return [float(engine.train_batch(data_iter=it)) for _ in steps]


def _resume(rank: int, save_dir: str) -> dict[str, Any]:
    """[Note: 3D checkpoints]: 2 steps, save, 2 more; a fresh engine loads and trains the same 2 steps. Then a
    pp2 x dp4 engine (no mpu) refuses the checkpoint."""
    from zeroshard.errors import ZeroshardError

    stream = batches()
    engine = build_engine(rank, FakeMpu(rank), "1f1b")
    _steps(engine, stream[:2])
    engine.save_checkpoint(save_dir)
    out: dict[str, Any] = {"straight": _steps(engine, stream[2:4])}
    engine.destroy()
    engine = build_engine(rank, FakeMpu(rank), "1f1b")
    engine.load_checkpoint(save_dir)
    out["resumed"] = _steps(engine, stream[2:4])
    engine.destroy()
    engine = build_engine(rank, FakeMpu(rank), "1f1b", mpu_given=False)
    try:
        engine.load_checkpoint(save_dir)
        out["checkpoint"] = "accepted"
    except ZeroshardError as e:
        out["checkpoint"] = str(e)
    engine.destroy()
    return out


def test_pp2_tp2_dp2_matches_reference_and_refuses_inconsistent_mpu(tmp_path: Path) -> None:
    schedules = ["1f1b", "gpipe", "interleaved"]
    per_rank = run_on_ranks(_train, PP * TP * DP, schedules, str(tmp_path))
    want, tied = reference(), reference(tied=True, sgd=True)[:-1]
    for rank, result in enumerate(per_rank):
        for schedule in schedules:
            got = result[schedule]
            assert all(math.isclose(g, w, rel_tol=RTOL) for g, w in zip(got, want, strict=True)), (
                rank,
                schedule,
                got,
                want,
            )
        # the tied input/output weight: replicated over tp (counted 1/tp per rank) and a copy on the last stage
        # (not counted there); SGD, so a norm counting it twice moves the losses
        assert all(math.isclose(g, w, rel_tol=RTOL) for g, w in zip(result["tied"], tied, strict=True)), (
            rank,
            result["tied"],
            tied,
        )
        assert "pipeline size 4 != the PipelineModule's num_stages 2" in result["pipe"], result["pipe"]
        assert "PipeModelDataParallelTopology" in result["layout"], result["layout"]
        assert result["resumed"] == result["straight"], (rank, result["resumed"], result["straight"])
        assert "saved with num_stages 2 and tensor_parallel 2" in result["checkpoint"], result["checkpoint"]
        assert "\n" not in result["checkpoint"]
        assert "autotp x pp is not implemented" in result["autotp"], result["autotp"]
