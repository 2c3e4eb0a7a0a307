"""Frozen weights held quantized at stage 3: DeepSpeed's `zero_quantized_nontrainable_weights` (ZeRO++).

[Note: quantized frozen weights]
With the key on, the frozen elements of each unit's shard (a LoRA base model's weights; [Note: frozen parameters at
stage 3] in unit.py puts them after the trainable ones) are held as 8-bit blocks with one fp32 scale each ([Note:
block quantization] in zero/quant.py), quantized once from their compute-dtype values when the unit is built: about
1 byte per frozen parameter / N instead of 2 (bf16) or 4 (fp32). A unit's shard is then its trainable prefix in the
compute dtype (`ShardedUnit.shard`, `trainable_shard_numel` elements, the same length on every rank) and a packed
tail (`PackedTail`, the rest). A gather sends both in one uint8 all-gather (the prefix's raw bytes, or its 8-bit
blocks with qwZ on) and every rank, its own part included, computes with the dequantized tail, so all replicas hold
the same frozen values; at one rank the tail is dequantized all the same, as DeepSpeed does. The loss of precision is
DeepSpeed's too: at most half a block's step per element (max |w| / 254 of its block of 256), once, at build; the
values never change after (nothing steps them). Trainable parameters, their masters, gradients and optimizer state
are untouched, and so is a unit whose trainable part fills its shards. As in DeepSpeed "non-trainable" is what the
optimizer does not step: with no optimizer (inference) every weight is held quantized.
- Gathers that hand values to the user (state_dict, GatheredParameters, `full_fp32_param`, consolidation, the
  checkpoint's module weights) give the dequantized values: the original ones are gone. A checkpoint saves them and
  a load quantizes them again, which gives back the same codes when the ranks and units are the same (a block's
  largest value, and so its scale, survives the round trip, and every element rounds back to its code), and
  values within the same bound otherwise.
- The persistent unit (parameters below stage3_param_persistence_threshold) stays gathered, so it is not quantized.
- Where the shard lives (offload_param: pinned host memory, or NVMe with the shard) the codes live too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from zeroshard.comm.collectives import Collectives, Handle
from zeroshard.offload.tier import Tier
from zeroshard.zero.quant import BlockQuantizer
from zeroshard.zero.zeropp.handles import Then

if TYPE_CHECKING:
    from zeroshard.zero.stage3.unit import ShardedUnit


class PackedTail:
    """The frozen elements of one unit's shard past its trainable prefix, as packed 8-bit blocks."""

    def __init__(self, quantizer: BlockQuantizer, numel: int, tier: Tier):
        self.quantizer = quantizer
        self.numel = numel
        self.codes = tier.zeros(quantizer.packed_bytes(numel), torch.uint8)  # on the shard's tier

    def pack(self, values: torch.Tensor) -> None:
        """Codes := `values` (`numel` elements, any dtype and device) quantized."""
        self.quantizer.pack(values.to(self.codes.device), self.codes)

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized elements, in `dtype` on the codes' device."""
        return self.quantizer.unpack(self.codes, self.numel, dtype)

    def gather(
        self,
        unit: ShardedUnit,
        comm: Collectives,
        prefix_quantizer: BlockQuantizer | None = None,
        then: Callable[[], None] | None = None,
    ) -> Callable[..., Handle]:
        """The gather of `unit` (called as `comm.all_gather(full, source, async_op=..., label=...)`, `source` unused):
        every rank's prefix (as 8-bit blocks with `prefix_quantizer`: qwZ) and tail in one uint8 all-gather, unpacked
        into the full buffer when the handle is waited on; `then` runs after that (hpZ's secondary fill)."""

        def collect(full: torch.Tensor, source: torch.Tensor, async_op: bool = False, label: str = "") -> Handle:
            return self._gather(unit, comm, prefix_quantizer, then, async_op, label)

        return collect

    def _gather(
        self,
        unit: ShardedUnit,
        comm: Collectives,
        prefix_quantizer: BlockQuantizer | None,
        then: Callable[[], None] | None,
        async_op: bool,
        label: str,
    ) -> Handle:
        full, prefix, world = unit.full, unit.shard, comm.world_size
        dtype, device, width = full.dtype, full.device, unit.layout.shard_numel
        head = _head_bytes(prefix.numel(), prefix.element_size(), prefix_quantizer)
        rows = torch.empty(world, head + self.codes.numel(), dtype=torch.uint8, device=device)
        mine = rows[comm.rank]
        if prefix.numel() and prefix_quantizer is not None:
            prefix_quantizer.pack(prefix.to(device), mine[:head])
        elif prefix.numel():
            raw = prefix.view(torch.uint8)
            mine[: raw.numel()].copy_(raw, non_blocking=raw.is_pinned())
        mine[head:].copy_(self.codes, non_blocking=self.codes.is_pinned())
        handle = comm.all_gather(rows.view(-1), mine, async_op=async_op, label=f"packed {label}")
        issued = _recorded(device)  # on CUDA: the stream the collective was issued from (a side stream, offload)

        def finish() -> None:
            if issued is not None:
                torch.cuda.current_stream(device).wait_event(issued)
                rows.record_stream(torch.cuda.current_stream(device))
            out = full.data.view(world, width)  # .data: [Note: gathered storage] in unit.py
            p = prefix.numel()
            if p and prefix_quantizer is not None:
                out[:, :p].copy_(prefix_quantizer.unpack(rows[:, :head], p, dtype))
            elif p:
                out[:, :p].copy_(rows[:, : p * prefix.element_size()].view(dtype))
            out[:, p:].copy_(self.quantizer.unpack(rows[:, head:], self.numel, dtype))
            if then is not None:
                then()

        return Then(handle, finish)


def _head_bytes(numel: int, element_size: int, quantizer: BlockQuantizer | None) -> int:
    """Bytes of a rank's row before its tail's codes: the prefix, padded to 4 (the codes' scales are fp32)."""
    if numel == 0:
        return 0
    if quantizer is not None:
        return quantizer.packed_bytes(numel)
    return -(-numel * element_size // 4) * 4


def _recorded(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
