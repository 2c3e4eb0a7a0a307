"""`deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3`: `engine.optimizer`'s class at stage 3 ([Note: the
engine's optimizer] in engine_optimizer.py)."""

from zeroshard.engine_optimizer import DeepSpeedZeroOptimizer_Stage3

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]
