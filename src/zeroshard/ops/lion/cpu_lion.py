"""`deepspeed.ops.lion.cpu_lion`: `DeepSpeedCPULion` at DeepSpeed's module path."""

from zeroshard.ops.lion import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
