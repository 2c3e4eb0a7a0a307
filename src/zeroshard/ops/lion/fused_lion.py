"""`deepspeed.ops.lion.fused_lion`: `FusedLion` at DeepSpeed's module path."""

from zeroshard.ops.lion import FusedLion

__all__ = ["FusedLion"]
