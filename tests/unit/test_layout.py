"""The flat layout is pure math: check coverage, padding, ownership and launch order without ranks."""

from __future__ import annotations

import random

import pytest

from zeroshard.zero.layout import ParamSpec, build_layout, counted_ranges, owned_pieces


def _random_groups(seed: int) -> list[list[ParamSpec]]:
    rng = random.Random(seed)
    order = list(range(40))
    rng.shuffle(order)
    groups: list[list[ParamSpec]] = [[], [], []]
    for i, o in enumerate(order):
        groups[rng.randrange(3)].append(ParamSpec(f"p{i}", rng.choice([1, 7, 64, 300, 1000, 5000]), o))
    return groups


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("shard_count", [1, 2, 3, 4])
@pytest.mark.parametrize("align", [1, 16])
def test_every_element_owned_exactly_once(seed, shard_count, align):
    groups = _random_groups(seed)
    layout = build_layout(groups, bucket_numel=2048, shard_count=shard_count, align=align)
    for g, group in enumerate(layout.groups):
        assert group.numel % shard_count == 0 and group.shard_numel * shard_count == group.numel
        # parameters do not overlap and lie inside their bucket
        covered = set()
        for slot in group.slots:
            bucket = next(b for b in group.buckets if b.id == slot.bucket)
            assert bucket.start <= slot.offset and slot.offset + slot.numel <= bucket.start + bucket.numel
            assert slot.offset % align == 0
            span = set(range(slot.offset, slot.offset + slot.numel))
            assert not span & covered
            covered |= span
        assert sorted(s.name for s in group.slots) == sorted(p.name for p in groups[g])
        # each parameter element is owned by exactly one rank, at a unique shard position
        owners: dict[tuple[int, int], int] = {}
        for rank in range(shard_count):
            positions = set()
            for piece in owned_pieces(group, rank):
                for k in range(piece.param_end - piece.param_begin):
                    key = (piece.slot, piece.param_begin + k)
                    assert key not in owners
                    owners[key] = rank
                    positions.add(piece.shard_offset + k)
            assert all(0 <= p < group.shard_numel for p in positions)
        assert len(owners) == sum(s.numel for s in group.slots)


def test_buckets_respect_size_and_backward_order():
    specs = [ParamSpec(f"p{i}", 100, i) for i in range(10)]
    layout = build_layout([specs], bucket_numel=250, shard_count=2)
    group = layout.groups[0]
    assert [len(b.slots) for b in group.buckets] == [2, 2, 2, 2, 2]
    # reverse registration order: the last parameter comes first in the buffer
    assert group.slots[0].name == "p9" and group.slots[-1].name == "p0"
    assert [b.id for b in layout.buckets_in_launch_order] == [0, 1, 2, 3, 4]


def test_large_parameter_gets_its_own_bucket_and_padding_is_small():
    specs = [ParamSpec("small", 10, 0), ParamSpec("big", 10_001, 1), ParamSpec("tail", 5, 2)]
    layout = build_layout([specs], bucket_numel=1000, shard_count=4)
    assert len(layout.groups[0].buckets) == 3
    assert layout.numel - layout.unpadded_numel < 3 * 4


def test_launch_order_interleaves_groups_by_backward_position():
    decay = [ParamSpec(f"w{i}", 100, 2 * i) for i in range(4)]
    no_decay = [ParamSpec(f"b{i}", 100, 2 * i + 1) for i in range(4)]
    layout = build_layout([decay, no_decay], bucket_numel=100, shard_count=2)
    names = [layout.groups[b.group].slots[b.slots[0]].name for b in layout.buckets_in_launch_order]
    assert names == ["b3", "w3", "b2", "w2", "b1", "w1", "b0", "w0"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="bucket_numel"):
        build_layout([[ParamSpec("p", 1, 0)]], bucket_numel=0, shard_count=1)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("shard_count", [1, 2, 3])
def test_counted_ranges_cover_the_shard_less_the_excluded_pieces(seed, shard_count):
    """[Note: tied copies in the norm]: the ranges are disjoint, sorted, and hold exactly the shard's elements
    outside the excluded parameters' pieces (padding included: it is zero and counts nothing)."""
    rng = random.Random(seed)
    specs = [ParamSpec(f"p{i}", rng.randint(1, 40), i) for i in range(rng.randint(1, 8))]
    group = build_layout([specs], rng.randint(5, 60), shard_count).groups[0]
    excluded = {s for s in range(len(group.slots)) if rng.random() < 0.4}
    for rank in range(shard_count):
        ranges = counted_ranges(group, rank, excluded)
        kept = [i for lo, hi in ranges for i in range(lo, hi)]
        assert kept == sorted(set(kept)) and all(lo < hi for lo, hi in ranges)
        dropped = {
            p.shard_offset + k
            for p in owned_pieces(group, rank)
            if p.slot in excluded
            for k in range(p.param_end - p.param_begin)
        }
        assert set(kept) == set(range(group.shard_numel)) - dropped
        if not excluded:
            assert ranges == [(0, group.shard_numel)]
