"""`deepspeed.runtime.engine`: `DeepSpeedEngine` (zeroshard's `Engine`, what `initialize` returns), the callable
types DeepSpeed's `initialize` accepts for `optimizer` and `lr_scheduler`, and the bucket-size constant scripts
import from it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zeroshard.engine import Engine

DeepSpeedEngine = Engine
DeepSpeedOptimizerCallable = Callable[[Iterable[torch.nn.Parameter] | dict[str, Iterable[Any]]], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], Any]
MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000  # DeepSpeed's `allreduce_bucket_size` default for stage 0

__all__ = ["MEMORY_OPT_ALLREDUCE_SIZE", "DeepSpeedEngine", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable"]
