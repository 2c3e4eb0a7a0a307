"""DeepSpeed's process topologies (`deepspeed.pipe.ProcessTopology`, `PipeDataParallelTopology`,
`PipeModelDataParallelTopology`) for scripts that build one: a grid of ranks over named axes, the last axis
fastest (rank = stage * dp * tp + d * tp + t for axes pipe, data, model). `PipelineModule(topology=...)` reads its
axes and dimensions ([Note: pipeline mesh], [Note: 3D mesh] in pipe/three_d.py); the methods answer as DeepSpeed's
do (tests/unit/test_pipe_topology.py compares them where DeepSpeed is installed).
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence
from itertools import product
from typing import Any


class ProcessTopology:
    """Ranks laid out over `axes` of sizes `dims` (row-major: the last axis varies fastest)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]):
        if len(axes) != len(dims) or len(set(axes)) != len(axes) or any(int(d) < 1 for d in dims):
            raise ValueError(f"ProcessTopology(axes={list(axes)}, dims={list(dims)}): one positive size per axis name")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        coord_type: Any = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        self.ProcessCoord = coord_type
        self._coords: list[Any] = [coord_type._make(c) for c in product(*(range(d) for d in self.dims))]
        self.mapping = {coord: rank for rank, coord in enumerate(self._coords)}

    def world_size(self) -> int:
        return len(self._coords)

    def __str__(self) -> str:
        return str(self.mapping)  # DeepSpeed's: every coordinate with its rank

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """The size of `axis` (0 for an axis this topology does not have, as DeepSpeed answers)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_rank(self, **coord: int) -> int:
        if sorted(coord) != sorted(self.axes):
            raise ValueError(f"get_rank() takes every axis of {self.axes} once, got {sorted(coord)}")
        key = self.ProcessCoord(**coord)
        if key not in self.mapping:
            raise ValueError(
                f"get_rank({coord}): outside the topology's sizes {dict(zip(self.axes, self.dims, strict=True))}"
            )
        return self.mapping[key]

    def get_coord(self, rank: int) -> Any:
        if not 0 <= rank < self.world_size():
            raise ValueError(f"get_coord({rank}): the topology has ranks 0..{self.world_size() - 1}")
        return self._coords[rank]

    def get_rank_repr(
        self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-"
    ) -> str:
        """e.g. "model_01": the rank's coordinates on the axes not omitted (DeepSpeed's checkpoint-name tag)."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit_axes
        )

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on `axis` is `idx`."""
        if axis not in self.axes:
            raise ValueError(f"get_axis_list({axis!r}): the topology's axes are {self.axes}")
        return [rank for rank, coord in enumerate(self._coords) if getattr(coord, axis) == idx]

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinates equal every given one."""
        return [
            rank
            for rank, coord in enumerate(self._coords)
            if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())
        ]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """One list per group along `axis` (the ranks that differ only there), in the other axes' order."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values, strict=True))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists


class PipeDataParallelTopology(ProcessTopology):
    """Axes pipe, data: a stage's data-parallel ranks are consecutive."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Axes pipe, data, model: a layer's tensor-parallel ranks are consecutive (3D parallelism)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def _prime_factors(n: int) -> list[int]:
    """DeepSpeed's helper: the prime factors of `n` > 0, ascending, with repeats (12 -> [2, 2, 3])."""
    if n <= 0:
        raise ValueError("Values must be strictly positive.")
    primes, candidate = [], 2
    while n != 1:
        while n % candidate == 0:
            primes.append(candidate)
            n //= candidate
        candidate += 1
    return primes
