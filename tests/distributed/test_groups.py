"""`deepspeed.utils.groups` answers for the engine built last ([Note: groups follow the engine] in
utils/groups.py): on 2 ranks, pure data parallelism, a 2-stage pipeline (data-parallel degree 1), an mpu's tensor
parallelism over both ranks, and MoE layers with `ep_size` 2 (whose one-rank expert-data-parallel group is one rank's
own, [Note: a one-rank group]); after `destroy`, the world again."""

from __future__ import annotations

from typing import Any

from torch import nn

from helpers.harness import run_on_ranks
from helpers.mpu import GroupsMpu


def _answers() -> dict[str, Any]:
    import torch.distributed as dist

    from zeroshard.utils import groups

    tp_group = groups.get_tensor_model_parallel_group()
    return {
        "dp": (groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()),
        "dp_ranks": list(groups._get_data_parallel_group_ranks()),
        "dp_group_size": dist.get_world_size(groups._get_data_parallel_group()),
        "mp": (groups._get_model_parallel_world_size(), groups.get_model_parallel_rank()),
        "tp_group_size": None if tp_group is None else dist.get_world_size(tp_group),
    }


class _WorldTensorParallel(GroupsMpu):
    """Both ranks in one tensor-parallel group; each its own data-parallel group."""

    def __init__(self, rank: int) -> None:
        import torch.distributed as dist

        self.tp_rank, self.tp_size, self.tp_group = rank, 2, dist.group.WORLD
        self.dp_rank, self.dp_size = 0, 1
        self.dp_group = next(g for g in (dist.new_group([0]), dist.new_group([1])) if dist.get_rank(g) == 0)


class _MegatronStyle(_WorldTensorParallel):
    """Megatron-DeepSpeed's parallel_state: tensor-parallel methods and sequence-parallel ones (one rank here)."""

    def get_sequence_parallel_group(self) -> Any:
        return None

    def get_sequence_parallel_world_size(self) -> int:
        return 1


def _engine(model: nn.Module, stage: int, **kwargs: Any) -> Any:
    import zeroshard

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    config["zero_optimization"] = {"stage": stage}
    return zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config, **kwargs)[0]


def _all(rank: int, world_size: int) -> dict[str, Any]:
    from helpers.moe_parity import MoeCase, MoeNet
    from helpers.pipeline import PipeCase, build
    from zeroshard.utils import groups

    out: dict[str, Any] = {}
    engine = _engine(nn.Linear(4, 4), 1)
    out["plain"] = _answers()
    engine.destroy()
    pipe = build(PipeCase(stages=2))
    out["pipeline"] = _answers()
    pipe.destroy()
    mpu = _WorldTensorParallel(rank)
    engine = _engine(nn.Linear(4, 4), 1, mpu=mpu)
    out["mpu"] = _answers()
    out["engine_mpu"] = (engine.mpu is mpu, engine.has_moe_layers, engine.num_experts)
    engine.destroy()
    engine = _engine(nn.Linear(4, 4), 1, mpu=_MegatronStyle(rank))  # sequence methods too: still tensor-parallel
    out["megatron_mpu"] = (_answers(), engine.sequence_parallel_size)
    engine.destroy()
    engine = _engine(MoeNet(MoeCase(num_experts=4), ep_size=2), 1)
    name = groups._get_max_expert_size_name()
    out["moe"] = (name, groups._get_max_expert_size(), groups._get_expert_parallel_world_size(name))
    out["moe"] += (groups._get_expert_data_parallel_world_size(name), groups._get_expert_parallel_rank(name))
    out["moe_dp"] = _answers()["dp"]
    out["moe_engine"] = (engine.has_moe_layers, engine.num_experts, engine.mpu)
    # [Note: a one-rank group]: a script's all-reduce over the expert-data-parallel group (one rank each, ep_size
    # the world) sums this rank's tensor alone (it summed the world's, the other expert's)
    import torch
    import torch.distributed as dist

    edp = groups._get_expert_data_parallel_group(name)
    mine = torch.tensor([float(rank + 1)])
    dist.all_reduce(mine, group=edp)
    out["edp_group"] = (dist.get_process_group_ranks(edp), mine.item())
    engine.destroy()
    out["after"] = _answers()
    try:
        groups._get_expert_parallel_group("ep_size_2")
    except KeyError as err:
        out["no_experts"] = str(err)
    # groups a script makes without an engine (DeepSpeed's own tests do), answered by the same accessors
    groups._create_expert_and_data_parallel(2)
    first = groups._all_experts()["ep_size_2"]
    groups._create_expert_and_data_parallel(2, use_data_before_expert_parallel_=True)  # kept, as DeepSpeed keeps them
    out["kept"] = groups._all_experts()["ep_size_2"] is first
    ep, edp = groups._get_expert_parallel_group("ep_size_2"), groups._get_expert_data_parallel_group("ep_size_2")
    out["made"] = (dist.get_process_group_ranks(ep), dist.get_process_group_ranks(edp))
    out["made"] += (sorted(groups._get_expert_parallel_group_dict()),)
    out["made"] += (groups._get_expert_broadcast_src_rank("ep_size_2"),)
    out["made"] += (groups._get_broadcast_src_rank(), groups._get_max_expert_size_name())
    return out


def test_groups_follow_the_engine_built_last() -> None:
    for rank, out in enumerate(run_on_ranks(_all, 2, timeout=300)):
        world = {"dp": (2, rank), "dp_ranks": [0, 1], "dp_group_size": 2, "mp": (1, 0), "tp_group_size": None}
        assert out["plain"] == world
        assert out["pipeline"] == {**world, "dp": (1, 0), "dp_ranks": [rank], "dp_group_size": 1}
        assert out["mpu"] == {**world, "dp": (1, 0), "dp_ranks": [rank], "dp_group_size": 1, "mp": (2, rank)} | {
            "tp_group_size": 2
        }
        assert out["megatron_mpu"] == (out["mpu"], 1)
        assert out["moe"] == ("ep_size_2", 2, 2, 1, rank)
        assert out["moe_dp"] == (2, rank)
        assert out["moe_engine"] == (True, [4], None) and out["engine_mpu"] == (True, False, [])
        assert out["edp_group"] == ([rank], float(rank + 1))
        assert out["after"] == world
        assert "ep_size_2" in out["no_experts"]
        assert out["made"] == ([0, 1], [rank], ["ep_size_2"], rank, 0, "ep_size_2") and out["kept"]
