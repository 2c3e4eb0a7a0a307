"""`deepspeed.compression.helper`: the two names scripts import from it (DeepSpeed-Chat's LoRA code)."""

from zeroshard.utils.module_utils import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
