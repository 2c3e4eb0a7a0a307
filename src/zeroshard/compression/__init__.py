"""`deepspeed.compression`: only its `helper` module's `recursive_getattr`/`recursive_setattr`, which DeepSpeed-Chat
imports from here. DeepSpeed's compression library itself (`init_compression`, `redundancy_clean`: quantization-aware
training and pruning) is not provided (docs/compat.md, Deliberately absent)."""

from zeroshard.compression import helper

__all__ = ["helper"]
