"""Flat-buffer layout for stages 0-2: pure functions of parameter sizes, no process group.

[Note: layout]
Each parameter group (same lr / weight decay) gets its own flat buffer, because the optimizer
steps one flat tensor per group. Inside a group, parameters are placed in reverse registration
order (the order backward produces their gradients) and cut into buckets of at most
`bucket_numel` elements (a parameter larger than that gets a bucket of its own). Every bucket is
padded to a multiple of `shard_count * align`, and rank r owns the r-th of its `shard_count`
equal slices. The shard a rank keeps for a group (master weights, optimizer state, stage-2
gradients) is the concatenation of its slices of every bucket of that group, so:
- a bucket's reduce-scatter writes straight into a contiguous range of the rank's shard;
- a bucket's all-gather reads that range and fills the bucket's parameter views in place.
This is Megatron-Core's distributed-optimizer layout. Buckets of all groups are launched in one
global order that every rank derives from the same sizes, so collectives always match across ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zeroshard.utils.chunks import greedy_chunks


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know of one trainable parameter."""

    name: str
    numel: int
    order: int  # registration index in the module; backward produces gradients roughly in reverse


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in its group's flat buffer."""

    name: str
    group: int
    index: int  # position in the group's parameter list
    offset: int
    numel: int
    bucket: int  # global bucket id


@dataclass(frozen=True)
class Bucket:
    """A contiguous, padded range of one group's buffer that is communicated with one collective."""

    id: int
    group: int
    start: int  # offset in the group's flat buffer
    numel: int  # padded; a multiple of shard_count
    shard_start: int  # offset of this bucket's slice in the group's shard
    shard_numel: int  # numel // shard_count
    slots: tuple[int, ...]  # indices into GroupLayout.slots
    ready_order: int  # launch position among all buckets

    def owner_range(self, rank: int) -> tuple[int, int]:
        """[begin, end) of this bucket's slice owned by `rank`, as offsets in the group buffer."""
        begin = self.start + rank * self.shard_numel
        return begin, begin + self.shard_numel


@dataclass(frozen=True)
class GroupLayout:
    group: int
    numel: int  # padded total of the group's buffer
    shard_numel: int
    slots: tuple[ParamSlot, ...]
    buckets: tuple[Bucket, ...]


@dataclass(frozen=True)
class FlatLayout:
    shard_count: int
    groups: tuple[GroupLayout, ...]

    @property
    def buckets_in_launch_order(self) -> tuple[Bucket, ...]:
        every = [b for g in self.groups for b in g.buckets]
        return tuple(sorted(every, key=lambda b: b.ready_order))

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.groups)

    @property
    def unpadded_numel(self) -> int:
        return sum(s.numel for g in self.groups for s in g.slots)

    @property
    def shard_numel(self) -> int:
        return sum(g.shard_numel for g in self.groups)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def build_layout(
    groups: Sequence[Sequence[ParamSpec]], bucket_numel: int, shard_count: int, align: int = 1
) -> FlatLayout:
    """Place every parameter of every group; see [Note: layout].

    `align` pads each parameter's start to a multiple of `align` elements (useful on CUDA for
    vectorised kernels) and each bucket to a multiple of `shard_count * align`.
    """
    if bucket_numel <= 0:
        raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
    if shard_count <= 0 or align <= 0:
        raise ValueError(f"shard_count and align must be positive, got {shard_count}, {align}")
    raw: list[tuple[int, list[ParamSlot], list[tuple[int, int, list[int], int]]]] = []
    for g, specs in enumerate(groups):
        backward_order = sorted(range(len(specs)), key=lambda i: -specs[i].order)
        sizes = [specs[i].numel for i in backward_order]
        offset, shard_offset = 0, 0
        slots: list[ParamSlot] = []
        bucket_rows: list[tuple[int, int, list[int], int]] = []
        for members in greedy_chunks(sizes, bucket_numel, close="before"):
            start = offset
            slot_ids: list[int] = []
            for m in members:
                spec_index = backward_order[m]
                spec = specs[spec_index]
                slot_ids.append(len(slots))
                slots.append(ParamSlot(spec.name, g, spec_index, offset, spec.numel, -1))
                offset = _round_up(offset + spec.numel, align)
            padded = _round_up(offset - start, shard_count * align)
            offset = start + padded
            earliest_needed = min(specs[backward_order[m]].order for m in members)
            bucket_rows.append((start, padded, slot_ids, earliest_needed))
            shard_offset += padded // shard_count
        raw.append((offset, slots, bucket_rows))

    # Global launch order: a bucket is complete when its earliest-registered parameter's gradient
    # arrives, so buckets whose earliest parameter is registered later are expected to finish first.
    keyed = [(-row[3], g, k) for g, (_, _, rows) in enumerate(raw) for k, row in enumerate(rows)]
    order = {(g, k): pos for pos, (_, g, k) in enumerate(sorted(keyed))}
    ids = {key: i for i, key in enumerate(sorted(order, key=lambda key: order[key]))}

    group_layouts: list[GroupLayout] = []
    for g, (total, slots, rows) in enumerate(raw):
        buckets: list[Bucket] = []
        shard_offset = 0
        for k, (start, padded, slot_ids, _) in enumerate(rows):
            bucket_id = ids[(g, k)]
            for s in slot_ids:
                slot = slots[s]
                slots[s] = ParamSlot(slot.name, g, slot.index, slot.offset, slot.numel, bucket_id)
            shard = padded // shard_count
            buckets.append(Bucket(bucket_id, g, start, padded, shard_offset, shard, tuple(slot_ids), order[(g, k)]))
            shard_offset += shard
        group_layouts.append(GroupLayout(g, total, total // shard_count, tuple(slots), tuple(buckets)))
    return FlatLayout(shard_count, tuple(group_layouts))


@dataclass(frozen=True)
class OwnedPiece:
    """Part of one parameter that falls in a rank's shard of a bucket."""

    slot: int  # index into GroupLayout.slots
    param_begin: int  # element range inside the flattened parameter
    param_end: int
    shard_offset: int  # where it starts in the rank's group shard


def owned_pieces(group: GroupLayout, rank: int) -> list[OwnedPiece]:
    """The pieces of parameters that `rank` owns in `group`, in shard order."""
    pieces: list[OwnedPiece] = []
    for bucket in group.buckets:
        lo, hi = bucket.owner_range(rank)
        for s in bucket.slots:
            slot = group.slots[s]
            begin, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if begin < end:
                pieces.append(OwnedPiece(s, begin - slot.offset, end - slot.offset, bucket.shard_start + begin - lo))
    return pieces


def counted_ranges(group: GroupLayout, rank: int, excluded: set[int]) -> list[tuple[int, int]]:
    """[begin, end) ranges of `rank`'s group shard left when the pieces of the slots in `excluded` are taken out
    (all of it, as one range, when none is): what the gradient norm counts ([Note: tied copies in the norm] in
    pipe/context.py)."""
    out, at = [], 0
    for piece in owned_pieces(group, rank):
        if piece.slot in excluded:
            if piece.shard_offset > at:
                out.append((at, piece.shard_offset))
            at = piece.shard_offset + piece.param_end - piece.param_begin
    if group.shard_numel > at:
        out.append((at, group.shard_numel))
    return out
