"""zeroshard.pipe's process topologies answer as DeepSpeed's (`deepspeed.pipe`), so `import zeroshard as deepspeed`
scripts that build one keep working; compared method by method where DeepSpeed is installed."""

from __future__ import annotations

import importlib.util

import pytest

from zeroshard.pipe import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology


def test_layout_is_row_major_with_model_fastest() -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"] and topo.world_size() == 8
    assert tuple(topo.get_coord(5)) == (1, 0, 1) and topo.get_rank(pipe=1, data=0, model=1) == 5
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.filter_match(pipe=1, model=0) == [4, 6] and topo.get_axis_list("pipe", 0) == [0, 1, 2, 3]
    assert topo.get_rank_repr(5) == "model_01" and topo.get_dim("model") == 2 and topo.get_dim("expert") == 0
    with pytest.raises(ValueError, match="every axis"):
        topo.get_rank(pipe=0, data=0)


def test_pipeline_module_reads_a_topology() -> None:
    from zeroshard.pipe.module import _from_topology

    assert _from_topology(PipeDataParallelTopology(num_pp=2, num_dp=3), None) == (2, 1)
    assert _from_topology(PipeModelDataParallelTopology(num_pp=3, num_mp=2, num_dp=2), 3) == (3, 2)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="compares with DeepSpeed's topologies")
@pytest.mark.parametrize("shape", [(2, 2, 2), (3, 1, 2), (1, 4, 1), (2, 3, 1)])
def test_every_method_matches_deepspeed(shape: tuple[int, int, int]) -> None:
    from deepspeed.runtime.pipe import topology as ds

    pp, mp, dp = shape
    for ours, theirs in (
        (PipeModelDataParallelTopology(pp, mp, dp), ds.PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=dp)),
        (PipeDataParallelTopology(pp, dp), ds.PipeDataParallelTopology(num_pp=pp, num_dp=dp)),
        (ProcessTopology(["x", "y"], [pp, dp]), ds.ProcessTopology(axes=["x", "y"], dims=[pp, dp])),
    ):
        assert ours.world_size() == theirs.world_size() and ours.get_axis_names() == theirs.get_axis_names()
        for rank in range(ours.world_size()):
            assert tuple(ours.get_coord(rank)) == tuple(theirs.get_coord(rank))
            assert ours.get_rank(**ours.get_coord(rank)._asdict()) == rank
            assert ours.get_rank_repr(rank) == theirs.get_rank_repr(rank)
        for axis in [*ours.axes, "other"]:
            assert ours.get_dim(axis) == theirs.get_dim(axis)
            assert ours.get_axis_comm_lists(axis) == theirs.get_axis_comm_lists(axis)
            for idx in range(ours.get_dim(axis)):
                assert ours.get_axis_list(axis, idx) == theirs.get_axis_list(axis, idx)
                assert ours.filter_match(**{axis: idx}) == theirs.filter_match(**{axis: idx})
        assert ours.filter_match() == theirs.filter_match()
        with pytest.raises(ValueError):
            ours.get_axis_list("other", 0)
