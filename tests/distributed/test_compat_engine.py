"""`import zeroshard as deepspeed` on 2 gloo ranks: a script's argument parsing, `init_distributed`,
`deepspeed.comm` collectives and the engine accessors DeepSpeed scripts read, `utils.safe_get_full_*` at every
stage (tests/helpers/safe_get_full_grid.py) and `runtime.utils.clip_grad_norm_` over the ranks, in one spawn."""

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
    deepspeed.init_distributed(dist_init_required=True)  # so is one that asks for a group (torch refused a second)
    comm = deepspeed.comm
    total = torch.tensor([float(comm.get_rank() + 1)])
    comm.all_reduce(total, op=comm.ReduceOp.SUM, log_name="loss")  # DeepSpeed's profiling keyword is accepted
    inference = torch.tensor([float(comm.get_rank() + 1)])
    comm.inference_all_reduce(inference)  # DeepSpeed's inference all-reduce (its shared-memory kernel where built)
    comm.barrier()
    rank, peer = comm.get_rank(), 1 - comm.get_rank()
    outputs = [torch.zeros(2), torch.zeros(2)]
    comm.all_to_all(outputs, [torch.tensor([10.0 * rank + i, 1.0]) for i in range(2)])
    coalesced = [torch.tensor([1.0 + rank]), torch.tensor([2.0 * (1 + rank)])]
    comm.all_reduce_coalesced(coalesced)
    gathered = [torch.zeros(2), torch.zeros(4)]
    comm.all_gather_coalesced(gathered, [torch.tensor([float(rank)]), torch.tensor([rank, 5.0])], async_op=True).wait()
    received = torch.zeros(1)
    ops = [comm.P2POp(comm.isend, torch.tensor([float(rank)]), peer), comm.P2POp(comm.irecv, received, peer)]
    for request in comm.batch_isend_irecv(ops):
        request.wait()
    launcher = (comm.get_world_rank_from_launcher(), comm.get_world_size_from_launcher())

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    applied = []
    for _ in range(4):
        engine.backward(engine(torch.randn(2, 4, dtype=torch.bfloat16)).float().pow(2).sum())
        engine.step()
        applied.append(engine.was_step_applied())
    facts = {
        "sum": (total.item(), inference.item()),
        "comm": (
            [t.tolist() for t in outputs],
            [t.item() for t in coalesced],
            [t.tolist() for t in gathered],
            received.item(),
            comm.get_all_ranks_from_group(),
            launcher,
            comm.has_all_gather_into_tensor() and comm.has_reduce_scatter_tensor(),
        ),
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


class _ModelParallelWorld:
    """A Megatron-style mpu whose model-parallel group is the whole world (DeepSpeed's `clip_grad_norm_` reads
    these two methods)."""

    def get_model_parallel_rank(self) -> int:
        return torch.distributed.get_rank()

    def get_model_parallel_group(self):
        return torch.distributed.group.WORLD


def _clip_grad_norm(rank: int) -> dict:
    """DeepSpeed's `clip_grad_norm_` with rank-dependent gradients: without an mpu the ranks' norms are averaged over
    the data-parallel group (the world here); with one, a parameter not marked model-parallel counts on
    model-parallel rank 0 only and the squares are summed over the model-parallel group first."""
    from zeroshard.runtime.utils import clip_grad_norm_

    def params() -> list[torch.nn.Parameter]:
        shared, split = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
        shared.grad = torch.tensor([3.0, 4.0]) * (rank + 1)  # norm 5 on rank 0, 10 on rank 1
        split.grad = torch.tensor([0.0, 12.0]) * (rank + 1)  # norm 12, 24
        split.tensor_model_parallel = True  # type: ignore[attr-defined]
        return [shared, split]

    plain = params()
    plain_norm = clip_grad_norm_(plain, max_norm=1.0)
    parallel = params()
    parallel_norm = clip_grad_norm_(parallel, max_norm=1e3, mpu=_ModelParallelWorld())
    return {
        "plain": (plain_norm.item(), plain[0].grad.tolist()),
        "parallel": (parallel_norm.item(), parallel[0].grad.tolist()),
    }


def _spawn(rank: int, world_size: int, config_path: str) -> dict:
    from helpers.safe_get_full_grid import run_grid

    return {
        "surface": _script(rank, world_size, config_path),
        "safe_get_full": run_grid(rank, world_size),
        "clip_grad_norm": _clip_grad_norm(rank),
    }


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
            "sum": (3.0, 3.0),
            "comm": (
                [[float(rank), 1.0], [10.0 + rank, 1.0]],  # all_to_all: part `rank` of each rank's inputs
                [3.0, 6.0],
                [[0.0, 1.0], [0.0, 5.0, 1.0, 5.0]],
                float(1 - rank),  # from the peer's isend
                [0, 1],
                (rank, 2),
                True,
            ),
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


def test_clip_grad_norm_averages_over_data_parallel_ranks_and_sums_over_model_parallel(ranks: list[dict]) -> None:
    import math

    local = [math.hypot(5 * (r + 1), 12 * (r + 1)) for r in range(2)]  # each rank's own norm: 13, 26
    plain = sum(local) / 2  # DeepSpeed's mean of the ranks' norms (for MoE, whose expert gradients differ by rank)
    # mpu: `shared` counted on model-parallel rank 0 only (5^2), `split` on both (12^2 + 24^2), then that norm
    # averaged over the data-parallel world: every rank computed the same value
    parallel = math.sqrt(5**2 + 12**2 + 24**2)
    for rank, result in enumerate(ranks):
        norm, grad = result["clip_grad_norm"]["plain"]
        assert norm == pytest.approx(plain, rel=1e-6)
        coefficient = 1.0 / (plain + 1e-6)
        assert grad == pytest.approx([3.0 * (rank + 1) * coefficient, 4.0 * (rank + 1) * coefficient], rel=1e-6)
        norm, grad = result["clip_grad_norm"]["parallel"]
        assert norm == pytest.approx(parallel, rel=1e-6)
        assert grad == [3.0 * (rank + 1), 4.0 * (rank + 1)]  # under max_norm: unchanged
