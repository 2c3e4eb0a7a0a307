"""`import zeroshard as deepspeed` on 2 gloo ranks: a script's argument parsing, `init_distributed`,
`deepspeed.comm` collectives and the engine accessors DeepSpeed scripts read, and `utils.safe_get_full_*` at every
stage (tests/helpers/safe_get_full_grid.py), in one spawn."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from helpers.harness import run_on_ranks


def _script(rank: int, world_size: int, config_path: str):
    import zeroshard as deepspeed
    from zeroshard.accelerator import get_accelerator
    from zeroshard.utils import groups

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", config_path])
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    deepspeed.init_distributed()  # a second call, as scripts and initialize() both make, is a no-op
    comm = deepspeed.comm
    total = torch.tensor([float(comm.get_rank() + 1)])
    comm.all_reduce(total, op=comm.ReduceOp.SUM, log_name="loss")  # DeepSpeed's profiling keyword is accepted
    comm.barrier()

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    applied = []
    for _ in range(4):
        engine.backward(engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().pow(2).sum())
        engine.step()
        applied.append(engine.was_step_applied())
    facts = {
        "sum": total.item(),
        "ranks": (comm.get_world_size(), groups._get_data_parallel_world_size(), engine.dp_world_size),
        "local_rank": engine.local_rank,
        "fp16": engine.fp16_enabled(),
        "bf16": engine.bfloat16_enabled(),
        "stage": (engine.zero_optimization_stage(), engine.zero_optimization()),
        "clip": engine.gradient_clipping(),
        "optimizer": engine.optimizer_name(),
        "monitor": engine.monitor.enabled,
        "applied": applied,
        "batch": engine.train_batch_size(),
    }
    engine.destroy()
    return facts


def _spawn(rank: int, world_size: int, config_path: str) -> dict:
    from helpers.safe_get_full_grid import run_grid

    return {"surface": _script(rank, world_size, config_path), "safe_get_full": run_grid(rank, world_size)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One spawn of 2 ranks for both tests below (start-up dominates their cost)."""
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
    }
    path = tmp_path_factory.mktemp("compat") / "ds_config.json"
    path.write_text(json.dumps(config))
    return run_on_ranks(_spawn, 2, str(path))


def test_deepspeed_script_surface_on_two_ranks(ranks: list[dict]) -> None:
    for rank, result in enumerate(ranks):
        assert result["surface"] == {
            "sum": 3.0,
            "ranks": (2, 2, 2),
            "local_rank": rank,
            "fp16": False,
            "bf16": True,
            "stage": (2, True),
            "clip": 0.5,
            "optimizer": "adam",  # DeepSpeed lower-cases its own optimizer names
            "monitor": False,
            "applied": [False, True, False, True],  # gradient_accumulation_steps = 8 / (2 * 2) = 2
            "batch": 8,
        }


def test_safe_get_full_matches_a_single_process_reference_at_every_stage(ranks: list[dict]) -> None:
    from helpers.safe_get_full_grid import check_grid

    check_grid([result["safe_get_full"] for result in ranks])
