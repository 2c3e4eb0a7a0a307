"""`deepspeed.ops.fp_quantizer`: group-wise fp8 quantization of bf16/fp16 tensors (`FP_Quantize`), in torch."""

from zeroshard.ops.fp_quantizer.quantize import FP_Quantize, Quantizer

__all__ = ["FP_Quantize", "Quantizer"]
