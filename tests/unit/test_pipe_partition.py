"""The pipeline's pure parts: stage boundaries (as DeepSpeed's partition functions) and the pp x dp rank grid."""

from __future__ import annotations

import random

import pytest

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.errors import ConfigError
from zeroshard.pipe.mesh import PipeGrid
from zeroshard.pipe.partition import partition, partition_balanced, partition_uniform, type_weights


@pytest.mark.parametrize("seed", range(20))
def test_partitions_match_deepspeed(seed: int) -> None:
    ds = import_deepspeed("deepspeed.runtime.utils")
    rng = random.Random(seed)
    n, parts = rng.randint(1, 14), rng.randint(1, 5)
    weights = [rng.choice([0, 0, 1, 7, 100, 4128]) for _ in range(n)]
    assert partition_uniform(n, parts) == list(ds.partition_uniform(n, parts))
    assert partition_balanced(weights, parts) == [int(x) for x in ds.partition_balanced(weights, parts)]


def test_partition_methods() -> None:
    names = ["Embedding", "Block", "Block", "Block", "Block", "LayerNorm", "Linear"]
    assert partition("uniform", [0] * 7, names, 2) == [0, 4, 7]
    assert type_weights(names, "block") == [0, 1, 1, 1, 1, 0, 0]
    assert partition("type:block", [0] * 7, names, 2) == partition_balanced([0, 1, 1, 1, 1, 0, 0], 2)
    with pytest.raises(NotImplementedError, match="profile"):
        partition("profile", [0] * 7, names, 2)


def test_grid_matches_deepspeeds_topology() -> None:
    topo = import_deepspeed("deepspeed.runtime.pipe.topology").PipeDataParallelTopology(num_pp=2, num_dp=3)
    grid = PipeGrid(stages=2, world_size=6)
    for rank in range(6):
        coord = topo.get_coord(rank)
        assert (grid.stage_of(rank), grid.replica_of(rank)) == (coord.pipe, coord.data)
    assert grid.dp_ranks(1) == [3, 4, 5] and grid.pp_ranks(2) == [2, 5]
    with pytest.raises(ConfigError, match="divide"):
        PipeGrid(stages=3, world_size=4)
