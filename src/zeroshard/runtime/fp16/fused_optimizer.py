"""`deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer`: `engine.optimizer`'s class at stage 0 in fp16 over
FusedAdam ([Note: the engine's optimizer] in engine_optimizer.py)."""

from zeroshard.engine_optimizer import FP16_Optimizer

__all__ = ["FP16_Optimizer"]
