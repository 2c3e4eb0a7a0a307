"""DeepSpeed's `deepspeed.profiling.flops_profiler`: `get_model_profile` and `FlopsProfiler` (profiler.py)."""

from zeroshard.profiling.flops_profiler.profiler import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
