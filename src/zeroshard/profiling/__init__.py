"""DeepSpeed's `deepspeed.profiling`: the FLOPs profiler as a standalone API (`flops_profiler`)."""

from zeroshard.profiling import flops_profiler

__all__ = ["flops_profiler"]
