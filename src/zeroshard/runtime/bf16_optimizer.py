"""`deepspeed.runtime.bf16_optimizer.BF16_Optimizer`: the class of `engine.optimizer` at stage 0 in bf16 ([Note: the
engine's optimizer] in engine_optimizer.py)."""

from zeroshard.engine_optimizer import BF16_Optimizer

__all__ = ["BF16_Optimizer"]
