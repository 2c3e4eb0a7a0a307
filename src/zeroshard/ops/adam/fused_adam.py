"""`deepspeed.ops.adam.fused_adam`: `FusedAdam` at DeepSpeed's module path."""

from zeroshard.ops.adam import FusedAdam

__all__ = ["FusedAdam"]
