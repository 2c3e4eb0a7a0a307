"""A stage-3 unit's flat layout (pure): the trainable parameters and the frozen ones in two sections, each split
evenly over the ranks ([Note: frozen parameters at stage 3] in zero/stage3/unit.py)."""

from __future__ import annotations

import torch

from zeroshard.zero.stage3.plan import layout_unit

FROZEN = 9


def test_each_rank_holds_a_chunk_of_each_section_and_its_trainable_elements_lead_its_shard() -> None:
    # registration order interleaves them, as a LoRA layer does (base weight, adapter A, adapter B, ...)
    rows = [("base.q", 1000, FROZEN), ("a.q", 40, 0), ("b.q", 40, 0), ("base.v", 1000, FROZEN), ("norm", 20, 1)]
    layout = layout_unit(rows, 4, align=16, frozen_group=FROZEN)
    order = [s.name for s in sorted(layout.slots, key=lambda s: s.offset)]
    assert order == ["a.q", "b.q", "norm", "base.q", "base.v"]
    assert layout.trainable_end == 96 + 20  # a.q at 0 and b.q at 48 (16-aligned), norm at 96
    assert layout.sections == ((0, 32), (128, 512))  # 116 padded to 4 x 32; the frozen section from 128
    assert layout.trainable_shard_numel == 32 and layout.frozen_width == 512
    assert layout.numel == 4 * layout.shard_numel == 128 + 4 * 512
    # every flat element is held by exactly one rank, once; the trainable ones in the holder's first 32 elements
    holder: dict[int, tuple[int, int]] = {}
    for rank in range(4):
        for lo, hi, at in layout.shard_ranges(rank):
            for x in range(lo, hi):
                assert x not in holder
                holder[x] = (rank, x - lo + at)
    assert sorted(holder) == list(range(layout.numel))
    for s in layout.slots:
        for x in range(s.offset, s.offset + s.numel):
            assert (holder[x][1] < 32) == (s.group != FROZEN), (s.name, x)
    # the adapters are spread over the ranks, not all on the first
    assert {holder[x][0] for s in layout.slots if s.group != FROZEN for x in range(s.offset, s.offset + s.numel)} == {
        0,
        1,
        2,
        3,
    }
    # take() and split() agree with shard_ranges()
    flat = torch.arange(layout.numel, dtype=torch.float64)
    for rank in range(4):
        shard = layout.take(flat, rank)
        assert [int(v) for v in shard] == [x for lo, hi, _ in layout.shard_ranges(rank) for x in range(lo, hi)]
        assert torch.equal(torch.cat([rows[rank] for rows, _ in layout.split(flat)]), shard)
    halves = layout.split(flat, 2)  # an hpZ group of 2: each section in 2 blocks
    assert [(rows.shape, at) for rows, at in halves] == [(torch.Size([2, 64]), 0), (torch.Size([2, 1024]), 64)]
    # group pieces in shard offsets: rank 3's trainable chunk [96, 128) is norm (group 1) up to 116
    assert layout.group_pieces(3) == [(1, 0, 20), (FROZEN, 32, 504)]  # the frozen range ends at 2136


def test_a_unit_of_one_kind_has_one_section_as_before() -> None:
    rows = [("w", 1000, 0), ("v", 10, 1)]
    layout = layout_unit(rows, 2, frozen_group=FROZEN)
    assert layout.sections == ((0, layout.shard_numel),) and layout.frozen_width == 0
    assert layout.trainable_shard_numel == layout.shard_numel
    assert layout.shard_ranges(1) == [(layout.shard_numel, 2 * layout.shard_numel, 0)]
    tiny = layout_unit([("w", 10, 0)], 2, frozen_group=FROZEN)  # the second rank's chunk is all padding
    assert tiny.trainable_shard_numel == 10 < tiny.shard_numel == 16
    all_frozen = layout_unit([("w", 1000, FROZEN)], 2, frozen_group=FROZEN)
    assert all_frozen.trainable_end == all_frozen.trainable_shard_numel == 0
    assert all_frozen.sections == ((0, all_frozen.shard_numel),) and all_frozen.frozen_width == all_frozen.shard_numel
    without = layout_unit([("w", 1000, 0)], 2)  # no frozen group given: everything trains
    assert without.trainable_shard_numel == without.shard_numel


def test_a_parameter_of_exactly_the_persistence_threshold_is_persistent() -> None:
    """DeepSpeed 0.19.8 keeps a parameter of at most `stage3_param_persistence_threshold` elements gathered
    (`ds_numel <= threshold` in `mark_persistent_parameters`); one more element and it is partitioned."""
    from torch import nn

    from zeroshard.zero.stage3.plan import PERSISTENT, plan_units

    model = nn.Sequential(nn.Sequential(nn.Linear(10, 10, bias=False)), nn.Sequential(nn.Linear(10, 10, bias=False)))

    def persistent(threshold: int) -> tuple[str, ...]:
        specs = {s.name: s.param_names for s in plan_units(model, None, threshold)}
        return specs.get(PERSISTENT, ())

    assert persistent(100) == ("0.0.weight", "1.0.weight")
    assert persistent(99) == ()
