"""A stage-3 unit's flat layout (pure): frozen parameters last, and the trainable prefix of every rank's shard
([Note: frozen parameters at stage 3] in zero/stage3/unit.py)."""

from __future__ import annotations

from zeroshard.zero.stage3.plan import layout_unit

FROZEN = 9


def test_frozen_parameters_go_last_and_the_trainable_prefix_covers_every_ranks_trainable_elements() -> None:
    # registration order interleaves them, as a LoRA layer does (base weight, adapter A, adapter B, ...)
    rows = [("base.q", 1000, FROZEN), ("a.q", 40, 0), ("b.q", 40, 0), ("base.v", 1000, FROZEN), ("norm", 20, 1)]
    layout = layout_unit(rows, 4, align=16, frozen_group=FROZEN)
    order = [s.name for s in sorted(layout.slots, key=lambda s: s.offset)]
    assert order == ["a.q", "b.q", "norm", "base.q", "base.v"]
    trainable_end = max(s.offset + s.numel for s in layout.slots if s.group != FROZEN)
    assert layout.trainable_end == trainable_end == 96 + 20  # a.q at 0 and b.q at 48 (16-aligned), norm at 96
    assert layout.trainable_shard_numel == trainable_end < layout.shard_numel
    for rank in range(4):  # every trainable element of a rank's chunk lies in its prefix
        lo, _ = layout.owned(rank)
        for s in layout.slots:
            if s.group != FROZEN:
                for x in range(max(lo, s.offset), min(lo + layout.shard_numel, s.offset + s.numel)):
                    assert x - lo < layout.trainable_shard_numel


def test_the_prefix_is_the_whole_shard_once_the_trainable_part_passes_one_rank() -> None:
    rows = [("w", 1000, 0), ("frozen", 10, FROZEN)]
    layout = layout_unit(rows, 2, frozen_group=FROZEN)
    assert layout.trainable_shard_numel == layout.shard_numel
    all_frozen = layout_unit([("w", 1000, FROZEN)], 2, frozen_group=FROZEN)
    assert all_frozen.trainable_end == all_frozen.trainable_shard_numel == 0
    without = layout_unit([("w", 1000, 0)], 2)  # no frozen group given: everything trains
    assert without.trainable_shard_numel == without.shard_numel
