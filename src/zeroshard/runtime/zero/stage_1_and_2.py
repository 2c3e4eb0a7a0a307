"""`deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer`: `engine.optimizer`'s class at stages 1-2 ([Note:
the engine's optimizer] in engine_optimizer.py)."""

from zeroshard.engine_optimizer import DeepSpeedZeroOptimizer

__all__ = ["DeepSpeedZeroOptimizer"]
