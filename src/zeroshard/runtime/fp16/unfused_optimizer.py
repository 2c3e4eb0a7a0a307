"""`deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer`: `engine.optimizer`'s class at stage 0 in fp16
over an optimizer other than FusedAdam ([Note: the engine's optimizer] in engine_optimizer.py)."""

from zeroshard.engine_optimizer import FP16_UnfusedOptimizer

__all__ = ["FP16_UnfusedOptimizer"]
