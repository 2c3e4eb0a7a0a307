"""`deepspeed.ops.lamb.fused_lamb`: `FusedLamb` at DeepSpeed's module path."""

from zeroshard.ops.lamb import FusedLamb

__all__ = ["FusedLamb"]
