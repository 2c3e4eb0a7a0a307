"""`deepspeed.runtime.dataloader`: `RepeatingLoader` at DeepSpeed's module path (pipeline scripts import it from
here; `deepspeed.utils.RepeatingLoader` is the same class)."""

from zeroshard.utils.repeating import RepeatingLoader

__all__ = ["RepeatingLoader"]
