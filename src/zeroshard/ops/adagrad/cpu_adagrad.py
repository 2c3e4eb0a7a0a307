"""`deepspeed.ops.adagrad.cpu_adagrad`: `DeepSpeedCPUAdagrad` at DeepSpeed's module path."""

from zeroshard.ops.adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
