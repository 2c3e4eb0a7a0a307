"""`zeroshard.utils.bwc` reads every generation of mpu: Megatron's current names, DeepSpeed's slice/pipe names, the
oldest model-parallel names, and none; the newest spelling wins where an mpu has several; an mpu with no spelling
is refused naming the methods. The answers are DeepSpeed 0.19.8's `deepspeed.utils.bwc`'s for the same fakes."""

from __future__ import annotations

from typing import Any

import pytest

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.utils import bwc

READERS = [
    "bwc_tensor_model_parallel_rank",
    "bwc_tensor_model_parallel_world_size",
    "bwc_tensor_model_parallel_group",
    "bwc_pipeline_parallel_world_size",
    "bwc_pipeline_parallel_group",
]


class Megatron:
    """Megatron-LM's current parallel_state (and DeepSpeed's groups): tensor and pipeline names."""

    def get_tensor_model_parallel_rank(self) -> int:
        return 1

    def get_tensor_model_parallel_world_size(self) -> int:
        return 4

    def get_tensor_model_parallel_group(self) -> str:
        return "megatron tp"

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 2

    def get_pipeline_model_parallel_group(self) -> str:
        return "megatron pp"


class Topology:
    """DeepSpeed's PipelineParallelGrid: slice and pipe names."""

    def get_slice_parallel_rank(self) -> int:
        return 2

    def get_slice_parallel_world_size(self) -> int:
        return 3

    def get_slice_parallel_group(self) -> str:
        return "slice"

    def get_pipe_parallel_world_size(self) -> int:
        return 5

    def get_pipe_parallel_group(self) -> str:
        return "pipe"


class Old:
    """The oldest Megatron mpu: model-parallel names only, no pipeline."""

    def get_model_parallel_rank(self) -> int:
        return 3

    def get_model_parallel_world_size(self) -> int:
        return 8

    def get_model_parallel_group(self) -> str:
        return "model"


class Every(Old, Topology, Megatron):
    """All three spellings: the newest is asked."""


class Nothing:
    pass


EXPECTED: dict[str, list[Any]] = {  # per reader: Megatron, Topology, Old, Every, None
    "bwc_tensor_model_parallel_rank": [1, 2, 3, 1, 0],
    "bwc_tensor_model_parallel_world_size": [4, 3, 8, 4, 1],
    "bwc_tensor_model_parallel_group": ["megatron tp", "slice", "model", "megatron tp", None],
    "bwc_pipeline_parallel_world_size": [2, 5, 1, 2, 1],
    "bwc_pipeline_parallel_group": ["megatron pp", "pipe", ValueError, "megatron pp", None],
}
MPUS = [Megatron(), Topology(), Old(), Every(), None]


@pytest.mark.parametrize("reader", READERS)
def test_each_generation_of_mpu(reader: str) -> None:
    for mpu, expected in zip(MPUS, EXPECTED[reader], strict=True):
        if expected is ValueError:
            with pytest.raises(ValueError, match="get_pipeline_model_parallel_group, get_pipe_parallel_group"):
                getattr(bwc, reader)(mpu)
        else:
            assert getattr(bwc, reader)(mpu) == expected, (reader, type(mpu).__name__)
    assert getattr(bwc, reader)() == EXPECTED[reader][-1]  # mpu defaults to None


@pytest.mark.parametrize("reader", READERS[:3])
def test_an_mpu_without_tensor_parallel_methods_is_refused(reader: str) -> None:
    with pytest.raises(ValueError, match=r"^the mpu Nothing has none of get_tensor_model_parallel_\w+, "):
        getattr(bwc, reader)(Nothing())


def test_a_tensor_parallel_mpu_has_one_pipeline_stage() -> None:
    assert bwc.bwc_pipeline_parallel_world_size(Nothing()) == 1


def test_answers_are_deepspeeds() -> None:
    theirs = import_deepspeed("deepspeed.utils.bwc")
    assert sorted(n for n in dir(theirs) if n.startswith("bwc_")) == sorted(READERS)  # every reader of theirs
    for reader in READERS:
        for mpu in [*MPUS, Nothing()]:
            try:
                expected = getattr(theirs, reader)(mpu)
            except (AssertionError, AttributeError):  # DeepSpeed's refusals; ours are a ValueError
                with pytest.raises(ValueError):
                    getattr(bwc, reader)(mpu)
                continue
            assert getattr(bwc, reader)(mpu) == expected, (reader, type(mpu).__name__)
