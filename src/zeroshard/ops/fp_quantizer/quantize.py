"""Group-wise fp8 quantization: DeepSpeed's `FP_Quantize` API over torch's float8 dtypes.

[Note: fp8 groups]
A tensor is cut into groups of `group_size` consecutive elements; each group is scaled so that its largest
magnitude becomes the format's largest finite value, rounded to the format (torch's cast: round to nearest even,
saturating), and kept as bytes followed by the group's fp32 scale (largest magnitude / format maximum): a
`[groups, group_size + 4]` uint8 tensor, DeepSpeed's layout for 8 bits. Dequantizing multiplies back in fp32 and
casts to the original dtype. The formats are torch's `float8_e4m3fn` (3 mantissa bits, largest 448) and
`float8_e5m2` (2 mantissa bits, largest 57344). DeepSpeed does the same in a CUDA kernel of its own (on CUDA only)
with its own fp8 variant and rounding, so quantized bytes differ from DeepSpeed's; the error bound is the format's
(half a unit in the last place of the scaled value). Widths other than 8 bits and stochastic rounding, which only
DeepSpeed's kernel has, are refused.
"""

from __future__ import annotations

import abc

import torch

_FORMATS = {3: torch.float8_e4m3fn, 2: torch.float8_e5m2}
_SCALE_BYTES = 4


def fp8_format(q_bits: int, mantissa_bits: int) -> torch.dtype:
    """The float8 dtype of `q_bits`/`mantissa_bits`; one line naming what is supported otherwise."""
    if q_bits != 8 or mantissa_bits not in _FORMATS:
        raise ValueError(
            f"fp quantization with q_bits={q_bits}, mantissa_bits={mantissa_bits} is not supported: zeroshard "
            "quantizes to 8 bits with mantissa_bits 3 (e4m3) or 2 (e5m2)"
        )
    return _FORMATS[mantissa_bits]


class Quantizer(abc.ABC):
    """DeepSpeed's quantizer interface: `quantize` and `dequantize` over groups of `group_size` elements."""

    def __init__(self, group_size: int = 512) -> None:
        self.group_size = group_size

    @abc.abstractmethod
    def quantize(
        self,
        input: torch.Tensor,
        q_bits: int = 8,
        q_mantisa_bits: int = 3,
        stochastic_mode: bool = False,
        return_meta_tensor: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def dequantize(
        self,
        input_q: torch.Tensor,
        fp_out: torch.Tensor | None = None,
        q_bits: int = 8,
        q_mantisa_bits: int = 3,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class FP_Quantize(Quantizer):
    """[Note: fp8 groups]. Remembers the last quantized tensor's shape and dtype, as DeepSpeed's, for `dequantize`.

    Example:
        >>> from zeroshard.linear import QuantizationConfig
        >>> quantizer = FP_Quantize(QuantizationConfig(group_size=4))
        >>> q = quantizer.quantize(torch.tensor([1.0, -2.0, 0.5, 4.0], dtype=torch.bfloat16))
        >>> q.shape, quantizer.dequantize(q).tolist()
        (torch.Size([1, 8]), [1.0, -2.0, 0.5, 4.0])
    """

    def __init__(self, quantization_config: object) -> None:
        super().__init__(group_size=int(getattr(quantization_config, "group_size", 512)))
        self.q_config = quantization_config
        self.orig_dtype: torch.dtype | None = None
        self.orig_shape: torch.Size | None = None
        self.num_groups: int | None = None

    def quantize(
        self,
        input: torch.Tensor,
        q_bits: int = 8,
        q_mantisa_bits: int = 3,
        stochastic_mode: bool = False,
        return_meta_tensor: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fmt = fp8_format(q_bits, q_mantisa_bits)
        if stochastic_mode:
            raise ValueError("fp quantization: stochastic_mode is not supported (round to nearest only)")
        if input.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"fp quantization takes bf16 or fp16 tensors, not {input.dtype}")
        if input.numel() % self.group_size:
            raise ValueError(
                f"fp quantization: {input.numel()} elements do not split into groups of {self.group_size}; "
                "set quantization group_size to a divisor of the weight's size"
            )
        self.orig_dtype, self.orig_shape = input.dtype, input.shape
        self.num_groups = input.numel() // self.group_size
        groups = input.detach().reshape(self.num_groups, self.group_size).float()
        largest = groups.abs().amax(dim=1, keepdim=True)
        if not largest.is_meta and not bool(torch.isfinite(largest).all()):  # (Transformers builds on meta)
            raise ValueError("fp quantization: the tensor holds inf or nan values, which no scale can represent")
        limit = torch.finfo(fmt).max
        # a group below limit / fp32's largest is scaled as if that were its largest (its factor stays finite)
        largest = torch.where(largest > 0, largest.clamp_min(limit / torch.finfo(torch.float32).max), largest)
        factor = torch.where(largest > 0, limit / largest, torch.zeros_like(largest))
        values = (groups * factor).to(fmt).view(torch.uint8)
        scale = (largest / limit).view(torch.uint8)
        if return_meta_tensor:
            return values.reshape(input.shape), scale
        return torch.cat([values, scale], dim=1)

    def dequantize(
        self,
        input_q: torch.Tensor,
        fp_out: torch.Tensor | None = None,
        q_bits: int = 8,
        q_mantisa_bits: int = 3,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.orig_dtype is None or self.orig_shape is None:
            raise RuntimeError("fp quantization: dequantize before any quantize (the shape and dtype come from it)")
        fmt = fp8_format(q_bits, q_mantisa_bits)
        packed = input_q.view(torch.uint8)
        if scale is not None:
            packed = torch.cat([packed.reshape(-1, self.group_size), scale.view(torch.uint8)], dim=-1)
        packed = packed.reshape(-1, self.group_size + _SCALE_BYTES)
        values = packed[:, : self.group_size].contiguous().view(fmt).float()
        factor = packed[:, self.group_size :].contiguous().view(torch.float32)
        out = (values * factor).to(self.orig_dtype).reshape(self.orig_shape)
        if fp_out is None:
            return out
        return fp_out.copy_(out)

    def to(self, *args: object, **kwargs: object) -> None:
        """Nothing to move: the quantized tensor carries its scales (DeepSpeed's moves its buffers)."""
