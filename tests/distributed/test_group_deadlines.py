"""[Note: sub-groups keep the world's deadline]: torch gives a new process group 30 minutes whatever the world group
has; the groups zeroshard makes (hpZ, MoE, pipeline, sequence parallelism through `new_group`; tensor parallelism's
device mesh) take the world's, so `zeroshard.collective_timeout_s` is their deadline too."""

from __future__ import annotations

from helpers.harness import run_on_ranks


def _deadlines(rank: int, world_size: int) -> dict[str, float]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import zeroshard
    from zeroshard.comm.topology import mesh_backend_override, new_group

    zeroshard.init_distributed(config={"train_batch_size": 2, "zeroshard": {"collective_timeout_s": 17}})

    def seconds(group) -> float:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    names = ("dp", "tp")
    # a dimension of the whole world reuses the world group (a new world-sized group would cost NCCL memory)
    mesh = init_device_mesh(
        "cpu", (2, 1), mesh_dim_names=names, backend_override=mesh_backend_override("cpu", names, (2, 1))
    )
    return {
        "world": seconds(torch.distributed.group.WORLD),
        "new_group": seconds(new_group([0, 1])),
        "mesh dp": seconds(mesh.get_group("dp")),
    }  # (the one-rank "tp" dimension never waits on anyone: left to torch)


def test_a_per_device_backend_string_picks_the_devices_backend() -> None:
    from zeroshard.comm.topology import _backend_for

    assert _backend_for("cpu:gloo,cuda:nccl", "cuda") == "nccl" and _backend_for("cpu:gloo,cuda:nccl", "cpu") == "gloo"
    assert _backend_for("gloo", "cpu") == "gloo"


def test_sub_groups_keep_the_worlds_deadline() -> None:
    for seen in run_on_ranks(_deadlines, 2):
        assert seen == {"world": 17.0, "new_group": 17.0, "mesh dp": 17.0}, seen


def _mesh_of_four(rank: int, world_size: int) -> list[float]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import zeroshard
    from zeroshard.comm.topology import mesh_backend_override

    zeroshard.init_distributed(config={"train_batch_size": 4, "zeroshard": {"collective_timeout_s": 17}})
    names = ("dp", "tp")
    override = mesh_backend_override("cpu", names, (2, 2))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names, backend_override=override)
    return [mesh.get_group(n)._get_backend(torch.device("cpu")).options._timeout.total_seconds() for n in names]


def test_a_mesh_dimension_smaller_than_the_world_gets_the_worlds_deadline() -> None:
    for seen in run_on_ranks(_mesh_of_four, 4):
        assert seen == [17.0, 17.0], seen
