"""All-gathers of a unit-sized flat buffer whose shards are one range per section ([Note: frozen parameters at
stage 3] in unit.py): one collective per section, each writing its section of the buffer in place."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard.comm.collectives import Handle, Joined
from zeroshard.zero.stage3.plan import Slot, UnitLayout

Gather = Callable[..., Handle]  # comm.all_gather's signature: (output, input, async_op=..., label=...)


def gather_flat(
    gather: Gather,
    layout: UnitLayout,
    full: torch.Tensor,
    source: torch.Tensor | None,
    rank: int,
    parts: int | None = None,
    async_op: bool = False,
    label: str = "",
) -> Handle:
    """`full` := every part's `source` (a part's whole buffer: a rank's shard, or an hpZ rank's secondary) put in
    place, section by section, over the `parts` ranks of `gather` (default: the shard count), `rank` being this
    one's place among them. `source` None: each section's chunk of `full` holds this rank's values already."""
    handles = []
    for rows, at in layout.split(full, parts):
        mine = rows[rank] if source is None else source.narrow(0, at, rows.shape[1])
        handles.append(gather(rows.view(-1), mine, async_op=async_op, label=label))
    return handles[0] if len(handles) == 1 else Joined(handles, lambda: None, async_op=True)


def write_slot(layout: UnitLayout, rank: int, slot: Slot, value: torch.Tensor, shard: torch.Tensor) -> None:
    """`rank`'s elements of `slot` in `shard` (a unit's shard or its prefix, a master) := `value`'s elements."""
    flat = value.detach().reshape(-1)
    for begin, end, at in layout.owned_parts(rank, slot.offset, slot.offset + slot.numel):
        end = min(end, begin + shard.numel() - at)  # a prefix shard (a master) ends early
        if begin < end:
            part = flat[begin - slot.offset : end - slot.offset].to(shard.device, shard.dtype)
            shard.narrow(0, at, end - begin).copy_(part)
