"""`deepspeed.runtime.fp16`: the classes of `engine.optimizer` at stage 0 in fp16 ([Note: the engine's optimizer] in
engine_optimizer.py) and the loss scalers' names."""

from zeroshard.runtime.fp16 import fused_optimizer, loss_scaler, unfused_optimizer

__all__ = ["fused_optimizer", "loss_scaler", "unfused_optimizer"]
