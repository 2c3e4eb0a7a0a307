"""Block-wise 8-bit quantization in plain torch ops, packed into one byte buffer per chunk. Pure functions.

[Note: block quantization]
ZeRO++ sends weights (qwZ) and gradients (qgZ) as 8-bit integers with one fp32 scale per block of consecutive
elements. A chunk of `numel` elements is cut into `ceil(numel / block_size)` blocks of equal length (the last
padded with zeros), so a small chunk is one short block rather than a mostly-padding 256-element one.
- symmetric (the default, as DeepSpeed's quantizer kernels for qwZ and qgZ): scale = max|x| / 127,
  q = round(x / scale) in [-127, 127]; zero maps to zero exactly. 4 bytes of scale per block.
- asymmetric: scale = (max - min) / 255, q = round((x - min) / scale) in [0, 255], x ~ q * scale + min; it uses
  the full range on one-sided data (e.g. post-ReLU), at 8 bytes of scale and offset per block.
The math runs in fp32 whatever the input dtype; dequantized values come back in the dtype asked for. A block's
error is at most scale / 2 per element (half a step). A non-finite element makes its block's scale non-finite, so
an overflow stays visible after the round trip (the fp16 loss scaler still sees it).

One chunk packs as `[scales (fp32) | codes (one byte each) | padding to 4 bytes]`, so a chunk per rank is one
equal-sized piece of a single uint8 collective (all-gather or all-to-all) with scales and codes together.
With the default block of 256 elements, a chunk costs 1 + 4/256 bytes per element: 0.254x of fp32, 0.51x of bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_BLOCK_SIZE = 256


@dataclass(frozen=True)
class BlockQuantizer:
    """How chunks are quantized ([Note: block quantization]): the largest block and the scheme."""

    block_size: int = DEFAULT_BLOCK_SIZE
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    # -- sizes (pure) ------------------------------------------------------------------------------
    def blocks(self, numel: int) -> tuple[int, int]:
        """(number of blocks, elements per block) for a chunk of `numel` elements."""
        count = max(1, -(-numel // self.block_size))
        return count, max(1, -(-numel // count))

    @property
    def scale_words(self) -> int:
        return 1 if self.symmetric else 2

    def packed_bytes(self, numel: int) -> int:
        """Bytes of one packed chunk, a multiple of 4 (so the next chunk's scales stay aligned)."""
        count, length = self.blocks(numel)
        raw = 4 * self.scale_words * count + count * length
        return -(-raw // 4) * 4

    # -- quantize / dequantize ---------------------------------------------------------------------
    def pack(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Quantize `x`, R rows of `numel` elements (or one flat chunk), into `out`: R rows of
        `packed_bytes(numel)` bytes (uint8; a flat tensor for one chunk)."""
        rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
        count_rows, numel = rows.shape
        count, length = self.blocks(numel)
        blocks = torch.zeros(count_rows, count * length, dtype=torch.float32, device=x.device)
        blocks[:, :numel].copy_(rows)
        blocks = blocks.view(count_rows, count, length)
        header, codes = self._split(out.view(count_rows, -1), count, length)
        if self.symmetric:
            scale = blocks.abs().amax(dim=2) / 127.0
            q = torch.round(blocks / _nonzero(scale)[..., None]).clamp_(-127, 127).to(torch.int8)
            codes.copy_(q.view(torch.uint8))
            header[:, 0].copy_(scale)
        else:
            low, high = blocks.amin(dim=2), blocks.amax(dim=2)
            scale = (high - low) / 255.0
            q = torch.round((blocks - low[..., None]) / _nonzero(scale)[..., None]).clamp_(0, 255).to(torch.uint8)
            codes.copy_(q)
            header[:, 0].copy_(scale)
            header[:, 1].copy_(low)

    def unpack(self, packed: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values packed rows hold: (R, numel) of `dtype` for R rows, flat for one flat chunk."""
        count_rows = packed.shape[0] if packed.dim() > 1 else 1
        count, length = self.blocks(numel)
        header, codes = self._split(packed.view(count_rows, -1), count, length)
        if self.symmetric:
            values = codes.view(torch.int8).float() * header[:, 0][..., None]
        else:
            values = codes.float() * header[:, 0][..., None] + header[:, 1][..., None]
        out = values.reshape(count_rows, count * length)[:, :numel].to(dtype)
        return out if packed.dim() > 1 else out.reshape(-1)

    def unpack_blocks(self, packed: torch.Tensor, numel: int, first: int, end: int) -> torch.Tensor:
        """The fp32 values of blocks [first, end) of one packed chunk of `numel` elements (flat, with the last
        block's padding): `unpack`'s arithmetic on a slice, so a large chunk can be unpacked a part at a time."""
        count, length = self.blocks(numel)
        header, codes = self._split(packed.view(1, -1), count, length)
        header, codes = header[:, :, first:end], codes[:, first:end]
        if self.symmetric:
            values = codes.view(torch.int8).float() * header[:, 0][..., None]
        else:
            values = codes.float() * header[:, 0][..., None] + header[:, 1][..., None]
        return values.reshape(-1)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What `x` becomes after pack and unpack (same dtype and shape): for tests and error estimates."""
        flat = x.reshape(-1)
        out = torch.empty(self.packed_bytes(flat.numel()), dtype=torch.uint8, device=x.device)
        self.pack(flat, out)
        return self.unpack(out, flat.numel(), x.dtype).view(x.shape)

    def _split(self, rows: torch.Tensor, count: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales as fp32 (R, words, count), codes as uint8 (R, count, length)) views of packed rows."""
        head = 4 * self.scale_words * count
        header = rows[:, :head].view(torch.float32).view(rows.shape[0], self.scale_words, count)
        codes = rows[:, head : head + count * length].view(rows.shape[0], count, length)
        return header, codes


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """`scale` with zeros (all-zero blocks) replaced by one, to divide by: their codes are zero either way."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))
