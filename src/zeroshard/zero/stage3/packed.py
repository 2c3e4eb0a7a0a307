"""Frozen weights held quantized at stage 3: DeepSpeed's `zero_quantized_nontrainable_weights` (ZeRO++).

[Note: quantized frozen weights]
With the key on, the frozen elements of each unit's shard (a LoRA base model's weights: the chunk of the unit's
frozen section every rank holds after its trainable chunk, [Note: frozen parameters at stage 3] in unit.py) are held
as 8-bit blocks with one fp32 scale each ([Note: block quantization] in zero/quant.py), quantized once from their
compute-dtype values when the unit is built: about 1 byte per frozen element instead of 2 (bf16) or 4 (fp32). A
rank's `ShardedUnit.shard` then keeps only its trainable chunk (`trainable_shard_numel` elements, the same on every
rank; the master, where it is the shard itself, covers exactly that) in the compute dtype and `PackedTail` holds the
frozen chunk. A gather sends every rank's kept elements (raw, or as 8-bit blocks with qwZ) and codes in one uint8
all-gather of equal rows and unpacks them into the two sections; every rank, its
own part included, computes with the dequantized values, so all replicas agree; at one rank the values are
dequantized all the same, as DeepSpeed does. Quantization error: at most half a block's step per element (max |w| /
254 of its block of 256), once, at build; DeepSpeed's CUDA quantizer uses larger groups. Trainable parameters, their
gradients and optimizer state are untouched.
- Differences from DeepSpeed, which quantizes each frozen parameter's own partition: the persistent unit
  (parameters at or below stage3_param_persistence_threshold, kept gathered) is not quantized; "frozen" is what the
  optimizer does not step, so with no optimizer (inference) every weight is packed, where DeepSpeed goes by
  `requires_grad`.
- With hpZ a packed unit's secondary partition is its hpZ rank's block of the forward gather's rows (N/H rows: the
  codes, about a byte per frozen element, where DeepSpeed also keeps these weights' secondary quantized), and the
  backward gather within the block unpacks those same bytes: backward computes with forward's values exactly.
- These are the only values left: state_dict, GatheredParameters, `full_fp32_param`, consolidation and the
  checkpoint's module weights give them (save and load dequantize the packed shards into host memory, the rank's
  unquantized shard size for the duration; one sub-group at a time with NVMe). A load quantizes them again, which
  gives back the same codes when the ranks and units are the same (a block's largest value, and so its scale,
  survives the round trip, and every element rounds back to its code) and values within one more step otherwise.
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
    """The frozen section's chunk of one unit's shard (`numel` elements, after the `kept` leading ones every rank keeps
    in the compute dtype) as packed 8-bit blocks."""

    def __init__(self, quantizer: BlockQuantizer, kept: int, numel: int, tier: Tier):
        self.quantizer = quantizer
        self.kept = kept
        self.numel = numel
        self.codes = tier.zeros(self.code_bytes(self.numel), torch.uint8)  # on the shard's tier

    def code_bytes(self, numel: int) -> int:
        return self.quantizer.packed_bytes(numel) if numel else 0

    def pack(self, values: torch.Tensor) -> None:
        """Codes := `values` (`numel` elements, any dtype) quantized where they are (a load's host copy is quantized
        on the host, and only the codes cross over)."""
        if not self.numel:
            return
        if values.device == self.codes.device:
            self.quantizer.pack(values, self.codes)
            return
        codes = torch.empty(self.codes.shape, dtype=torch.uint8, device=values.device)
        self.quantizer.pack(values, codes)
        self.codes.copy_(codes)

    def values(self, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """The dequantized elements, in `dtype` on `device` (default: the codes'): the codes go over, then are
        unpacked there a few blocks at a time (fp32 temporaries near UNPACK_CHUNK elements)."""
        device = device or self.codes.device
        out = torch.empty(self.numel, dtype=dtype, device=device)
        if not self.numel:
            return out
        codes = self.codes.to(device)
        count, length = self.quantizer.blocks(self.numel)
        step = max(1, UNPACK_CHUNK // length)
        for first in range(0, count, step):
            end = min(first + step, count)
            lo, hi = first * length, min(end * length, self.numel)
            out[lo:hi].copy_(self.quantizer.unpack_blocks(codes, self.numel, first, end)[: hi - lo])
        return out

    def row_bytes(self, element_size: int, prefix_quantizer: BlockQuantizer | None) -> int:
        """Bytes of one rank's row in the gather: its kept elements and its codes."""
        return _head_bytes(self.kept, element_size, prefix_quantizer) + self.code_bytes(self.numel)

    def gather(
        self,
        unit: ShardedUnit,
        comm: Collectives,
        prefix_quantizer: BlockQuantizer | None = None,
        then: Callable[[torch.Tensor], None] | None = None,
    ) -> Callable[..., Handle]:
        """The gather of `unit` (called as `comm.all_gather(full, source, async_op=..., label=...)`, `source` unused):
        every rank's kept elements (as 8-bit blocks with `prefix_quantizer`: qwZ) and codes in one uint8 all-gather
        of rows, unpacked into the full buffer when the handle is waited on; `then(rows)` runs after that
        (hpZ keeps its block of the rows as the secondary partition)."""

        def collect(full: torch.Tensor, source: torch.Tensor, async_op: bool = False, label: str = "") -> Handle:
            return self._gather(unit, comm, prefix_quantizer, then, async_op, label)

        return collect

    def _gather(
        self,
        unit: ShardedUnit,
        comm: Collectives,
        prefix_quantizer: BlockQuantizer | None,
        then: Callable[[torch.Tensor], None] | None,
        async_op: bool,
        label: str,
    ) -> Handle:
        full, prefix = unit.full, unit.shard
        device, size = full.device, full.element_size()
        rows = torch.empty(comm.world_size, self.row_bytes(size, prefix_quantizer), dtype=torch.uint8, device=device)
        mine, head = rows[comm.rank], _head_bytes(prefix.numel(), size, prefix_quantizer)
        if prefix.numel() and prefix_quantizer is not None:
            prefix_quantizer.pack(prefix.to(device), mine[:head])
        elif prefix.numel():
            raw = prefix.view(torch.uint8)
            mine[: raw.numel()].copy_(raw, non_blocking=raw.is_pinned())
        mine[head : head + self.codes.numel()].copy_(self.codes, non_blocking=self.codes.is_pinned())
        handle = comm.all_gather(rows.view(-1), mine, async_op=async_op, label=f"packed {label}")
        return self.unpacking(unit, rows, handle, prefix_quantizer, then)

    def unpacking(
        self,
        unit: ShardedUnit,
        rows: torch.Tensor,
        handle: Handle,
        prefix_quantizer: BlockQuantizer | None,
        then: Callable[[torch.Tensor], None] | None = None,
    ) -> Handle:
        """`handle` (of the collective filling `rows`, every rank's row), then the rows unpacked into `unit.full`."""
        full, kept, numel = unit.full, self.kept, self.numel
        dtype, device, size = full.dtype, full.device, full.element_size()
        issued = _recorded(device)  # on CUDA: the stream the collective was issued from (a side stream, offload)

        def finish() -> None:
            if issued is not None:
                torch.cuda.current_stream(device).wait_event(issued)
                rows.record_stream(torch.cuda.current_stream(device))
            # each section's [rank, chunk] view ([Note: frozen parameters at stage 3] in unit.py): the kept elements
            # are the trainable section's chunk, the codes the frozen one's (.data: [Note: gathered storage])
            sections = [rows_of for rows_of, _ in unit.layout.split(full.data)]
            trained, frozen = sections[0] if kept else None, sections[-1]
            head = _head_bytes(kept, size, prefix_quantizer)
            # a few rows at a time: the fp32 temporaries stay near UNPACK_CHUNK elements whatever the unit's size
            # (copy_ rounds them as .to would)
            step = max(1, UNPACK_CHUNK // (kept + numel))
            for a in range(0, rows.shape[0], step):
                b = min(a + step, rows.shape[0])
                if trained is not None and prefix_quantizer is not None:
                    trained[a:b].copy_(prefix_quantizer.unpack(rows[a:b, :head], kept))
                elif trained is not None:
                    trained[a:b].copy_(rows[a:b, : kept * size].view(dtype))
                frozen[a:b].copy_(self.quantizer.unpack(rows[a:b, head : head + self.code_bytes(numel)], numel))
            if then is not None:
                then(rows)

        return Then(handle, finish)


UNPACK_CHUNK = 1 << 24  # elements dequantized at once (64 MiB of fp32), at least one rank's row


def _head_bytes(numel: int, element_size: int, quantizer: BlockQuantizer | None) -> int:
    """Bytes of a rank's row before its codes: its kept elements, padded to 4 (the codes' scales are fp32)."""
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
