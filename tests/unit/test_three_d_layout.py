"""[Note: 3D mesh]'s rank arithmetic and the refusals of an mpu or a topology that do not fit the pipeline, without
a process group."""

from __future__ import annotations

from typing import Any

import pytest

from zeroshard.errors import ConfigError
from zeroshard.pipe.module import _from_topology
from zeroshard.pipe.three_d import check_layout, expected_ranks, pipeline_size


def test_expected_ranks_follow_pipe_model_data_parallel_topology() -> None:
    # pp2 x dp2 x tp2: rank = stage * 4 + d * 2 + t
    assert expected_ranks(2, 8, 2, 0) == ([0, 1], [0, 2])
    assert expected_ranks(2, 8, 2, 5) == ([4, 5], [5, 7])
    assert expected_ranks(2, 8, 2, 6) == ([6, 7], [4, 6])
    assert expected_ranks(2, 16, 4, 9) == ([8, 9, 10, 11], [9, 13])


def test_check_layout_accepts_the_topology_in_any_group_order() -> None:
    check_layout(2, 8, 5, [5, 4], [7, 5])


@pytest.mark.parametrize(
    ("stages", "world", "rank", "tp_ranks", "dp_ranks", "expected"),
    [
        (2, 8, 0, [0, 1], [0, 2, 4, 6], "num_stages 2 x model-parallel size 2 x data-parallel size 4 != world size 8"),
        (4, 8, 0, [0, 1], [0, 2], "num_stages 4 x model-parallel size 2"),
        (2, 8, 0, [0, 2], [0, 1], "PipeModelDataParallelTopology"),  # tp ranks not consecutive
        (2, 8, 4, [0, 1], [0, 2], "PipeModelDataParallelTopology"),  # the groups of another stage
    ],
)
def test_check_layout_refuses_an_inconsistent_mpu(
    stages: int, world: int, rank: int, tp_ranks: list[int], dp_ranks: list[int], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        check_layout(stages, world, rank, tp_ranks, dp_ranks)
    assert "\n" not in str(info.value)


class _Mpu:
    def get_pipe_parallel_world_size(self) -> int:
        return 3


class _Topology:
    def __init__(self, axes: list[str], dims: dict[str, int]) -> None:
        self.axes, self.dims = axes, dims

    def get_dim(self, axis: str) -> int:
        return self.dims[axis]


def test_pipeline_size_reads_the_mpu_where_it_says_one() -> None:
    assert pipeline_size(_Mpu()) == 3
    assert pipeline_size(object()) is None


def test_deepspeed_topology_gives_stages_and_model_size() -> None:
    three_d = _Topology(["pipe", "data", "model"], {"pipe": 2, "data": 2, "model": 2})
    assert _from_topology(three_d, None) == (2, 2)
    assert _from_topology(_Topology(["pipe", "data"], {"pipe": 4, "data": 2}), 4) == (4, 1)
    with pytest.raises(ConfigError, match="pass one"):
        _from_topology(three_d, 4)
    bad: Any = _Topology(["data", "pipe"], {"pipe": 2, "data": 4})
    with pytest.raises(ConfigError, match="axes pipe, data"):
        _from_topology(bad, None)
