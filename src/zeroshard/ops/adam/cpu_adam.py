"""`deepspeed.ops.adam.cpu_adam`: `DeepSpeedCPUAdam` at DeepSpeed's module path."""

from zeroshard.ops.adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
