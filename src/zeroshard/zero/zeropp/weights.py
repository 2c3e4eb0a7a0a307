"""qwZ and hpZ: how a stage-3 unit's full parameters are gathered in forward and backward ([Note: ZeRO++]).

`UnitGathers.collect(unit)` returns the gather to use in place of the plain all-gather (None: the plain one): qwZ
packs this rank's shard into 8-bit blocks, all-gathers the packed bytes and dequantizes every rank's part into the
unit's full buffer when the handle is waited on. With hpZ the first gather of a unit after a root forward begins
copies this rank's part of the secondary partition out of its result; every later gather of the unit before the
next forward (backward, a prefetch for backward issued while forward still runs, activation-checkpoint recompute,
a second forward call) all-gathers the secondaries within the hpZ block. "Fresh" is decided by the same sequence of
events on every rank, so all ranks of a group pick the same collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeroshard.comm.collectives import Collectives, Handle
from zeroshard.zero.quant import BlockQuantizer
from zeroshard.zero.stage3.packed import UNPACK_CHUNK
from zeroshard.zero.stage3.sections import gather_flat
from zeroshard.zero.stage3.unit import ShardedUnit
from zeroshard.zero.zeropp.handles import Then
from zeroshard.zero.zeropp.policy import ZeroPPGroups, ZeroPPPolicy

# comm.all_gather's signature, (output, input, async_op=..., label=...); input None: this rank's shard is in place in
# the output (ShardedUnit._issue)
Collect = Callable[..., Handle]


class UnitGathers:
    def __init__(self, policy: ZeroPPPolicy, comm: Collectives, groups: ZeroPPGroups, units: list[ShardedUnit]):
        self.policy = policy
        self.comm = comm
        self.groups = groups
        self.secondary: dict[int, torch.Tensor] = {}
        if policy.hpz:
            size = policy.hpz_partition_size
            for unit in units:
                if unit.tail is not None:  # its block of the packed gather's rows ([Note: quantized frozen weights])
                    rows = unit.tail.row_bytes(unit.full.element_size(), self._prefix_quantizer())
                    self.secondary[unit.index] = torch.zeros(
                        comm.world_size // size * rows, dtype=torch.uint8, device=unit.full.device
                    )
                elif not unit.persistent:  # it stays gathered: backward never gathers it
                    self.secondary[unit.index] = torch.zeros(
                        unit.numel // size, dtype=unit.full.dtype, device=unit.full.device
                    )
        self.fresh: set[int] = set()  # units whose secondary holds this step's forward values

    @property
    def secondary_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.secondary.values())

    def new_forward(self) -> None:
        """A new forward: the secondaries are stale (a step, a load may have changed the shards since)."""
        self.fresh.clear()

    def collect(self, unit: ShardedUnit) -> Collect | None:
        if unit.persistent:
            return None
        if unit.index in self.fresh:
            return lambda full, source, async_op=False, label="": self._from_secondary(unit, async_op, label)
        fill = unit.index in self.secondary
        if unit.tail is not None:  # its own packed gather ([Note: quantized frozen weights] in stage3/packed.py)
            keep = (lambda rows: self._fill_rows(unit, rows)) if fill else None
            return unit.tail.gather(unit, self.comm, self._prefix_quantizer(), keep)
        if self.policy.quantized_weights:
            return lambda full, source, async_op=False, label="": self._quantized(unit, source, fill, async_op, label)
        if fill:
            return lambda full, source, async_op=False, label="": Then(
                gather_flat(self.comm.all_gather, unit.layout, full, source, self.comm.rank, None, async_op, label),
                lambda: self._fill(unit),
            )
        return None

    def _quantized(
        self, unit: ShardedUnit, source: torch.Tensor | None, fill: bool, async_op: bool, label: str
    ) -> Handle:
        """`source`: this rank's shard, or None when it is in place in the full buffer (offload_param)."""
        quantizer, world = self.policy.quantizer, self.comm.world_size
        source = unit.layout.take(unit.full, self.comm.rank) if source is None else source
        shard_numel = unit.layout.shard_numel
        width = quantizer.packed_bytes(shard_numel)
        packed = torch.empty(world, width, dtype=torch.uint8, device=unit.full.device)
        mine = packed[self.comm.rank]
        quantizer.pack(source, mine)
        handle = self.comm.all_gather(packed.view(-1), mine, async_op=async_op, label=f"qwZ {label}")

        def finish() -> None:
            sections = unit.layout.split(unit.full.data)  # .data: [Note: gathered storage]
            step = max(1, UNPACK_CHUNK // shard_numel)  # a few rows at a time: bounded fp32 temporaries
            for a in range(0, world, step):
                values = quantizer.unpack(packed[a : a + step], shard_numel)
                for rows, at in sections:
                    rows[a : a + step].copy_(values[:, at : at + rows.shape[1]])
            if fill:
                self._fill(unit)

        return Then(handle, finish)

    def _prefix_quantizer(self) -> BlockQuantizer | None:
        """How a packed unit's kept elements travel: as 8-bit blocks with qwZ, else raw."""
        return self.policy.quantizer if self.policy.quantized_weights else None

    def _fill_rows(self, unit: ShardedUnit, rows: torch.Tensor) -> None:
        """A packed unit's secondary := this hpZ rank's block of the forward gather's rows (the same bytes: the
        backward gather from it unpacks exactly forward's values, at a byte per frozen element)."""
        secondary = self.secondary[unit.index]
        assert self.groups.hpz is not None
        block = secondary.numel() // rows.shape[1]
        secondary.copy_(rows[self.groups.hpz.rank * block : (self.groups.hpz.rank + 1) * block].reshape(-1))
        self.fresh.add(unit.index)

    def _fill(self, unit: ShardedUnit) -> None:
        """This rank's part of the secondary partition := the forward gather's result (no communication): its hpZ
        rank's block of each section."""
        secondary = self.secondary[unit.index]
        assert self.groups.hpz is not None
        for rows, at in unit.layout.split(unit.full.data, self.groups.hpz.world_size):
            secondary.narrow(0, at, rows.shape[1]).copy_(rows[self.groups.hpz.rank])
        self.fresh.add(unit.index)

    def _from_secondary(self, unit: ShardedUnit, async_op: bool, label: str) -> Handle:
        assert self.groups.hpz is not None
        secondary = self.secondary[unit.index]
        if unit.tail is not None:  # the rows of every rank, unpacked as the forward gather's were
            width = secondary.numel() * self.groups.hpz.world_size // self.comm.world_size  # bytes per rank's row
            rows = torch.empty(self.comm.world_size, width, dtype=torch.uint8, device=secondary.device)
            handle = self.groups.hpz.all_gather(rows.view(-1), secondary, async_op=async_op, label=f"hpZ {label}")
            return unit.tail.unpacking(unit, rows, handle, self._prefix_quantizer())
        hpz = self.groups.hpz
        return gather_flat(
            hpz.all_gather, unit.layout, unit.full.data, secondary, hpz.rank, hpz.world_size, async_op, f"hpZ {label}"
        )
