"""`deepspeed.runtime.data_pipeline`: the curriculum scheduler of the legacy `curriculum_learning` block."""

from zeroshard.runtime.data_pipeline import curriculum_scheduler

__all__ = ["curriculum_scheduler"]
