"""Ulysses sequence parallelism without a process group: the head split (DeepSpeed's), DeepSpeed's signatures and
rotary helper, and the groups' answers without sequence parallelism. Exchanges and training: tests/distributed/
test_sequence_parallel.py and test_sequence_parallel_deepspeed.py."""

from __future__ import annotations

import inspect

import pytest
import torch

from helpers.deepspeed_reference import import_deepspeed
from zeroshard.sequence import layer
from zeroshard.utils import groups


@pytest.mark.parametrize(
    "heads, kv, world, splits",
    [
        (8, None, 2, [4, 4]),
        (8, None, 4, [2, 2, 2, 2]),
        (7, None, 4, [2, 2, 2, 1]),  # DeepSpeed's example: 7 heads over 4 ranks
        (3, 3, 2, [2, 1]),
        (12, 4, 2, [6, 6]),  # GQA: 3 query heads per key/value head
        (6, 3, 2, [4, 2]),  # GQA, uneven: a rank's query heads follow its key/value heads
        (8, 8, 8, [1] * 8),
    ],
)
def test_head_splits_follow_deepspeeds_partition(heads: int, kv: int | None, world: int, splits: list[int]) -> None:
    assert layer.head_splits(heads, kv, world) == splits
    ds_shard = import_deepspeed("deepspeed.module_inject.tp_shard")
    meta = ds_shard.AutoTPMeta(num_kv_heads=kv if kv is not None else heads)
    assert ds_shard.get_shard_size_list(heads, world, meta) == splits


def test_head_splits_refuse_fewer_heads_than_ranks_and_broken_groups() -> None:
    with pytest.raises(ValueError, match="a rank would have no head"):
        layer.head_splits(2, None, 4)
    with pytest.raises(ValueError, match="not a multiple of 4 key/value heads"):
        layer.head_splits(6, 4, 2)


def test_signatures_are_deepspeeds() -> None:
    ds_layer = import_deepspeed("deepspeed.sequence.layer")
    for name in ("DistributedAttention", "single_all_to_all", "apply_rotary_pos_emb"):
        assert list(inspect.signature(getattr(layer, name)).parameters) == list(
            inspect.signature(getattr(ds_layer, name)).parameters
        ), name
    for method in ("forward",):
        ours, theirs = getattr(layer.DistributedAttention, method), getattr(ds_layer.DistributedAttention, method)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters)
    assert list(inspect.signature(layer._SeqAllToAll.forward).parameters) == list(
        inspect.signature(ds_layer._SeqAllToAll.forward).parameters
    )
    ds_sp = import_deepspeed("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    from zeroshard.runtime.sequence_parallel import parallel_state_sp

    public = {n for n in vars(ds_sp) if n.startswith(("get_", "initialize_", "_release"))}
    assert public <= set(vars(parallel_state_sp)), public - set(vars(parallel_state_sp))


def test_rotary_embedding_is_deepspeeds() -> None:
    ds_layer = import_deepspeed("deepspeed.sequence.layer")
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(6, 2, 3, 8, generator=gen)
    cos, sin = torch.randn(6, 1, 1, 6, generator=gen), torch.randn(6, 1, 1, 6, generator=gen)
    assert torch.equal(layer.apply_rotary_pos_emb(t, cos, sin), ds_layer.apply_rotary_pos_emb(t, cos, sin))


def test_groups_without_sequence_parallelism() -> None:
    assert groups._get_sequence_parallel_world_size() == 1 and groups._get_sequence_parallel_rank() == 0
    with pytest.raises(KeyError, match="No sequence parallel group"):
        groups._get_sequence_parallel_group()
    assert groups._get_sequence_data_parallel_world_size() == 1


def test_distributed_attention_without_a_group_or_engine_says_what_to_do() -> None:
    attention = layer.DistributedAttention(lambda q, k, v: q)
    q = torch.zeros(1, 2, 2, 4)
    with pytest.raises(ValueError, match="set sequence_parallel_size in the config"):
        attention(q, q, q, 0)
