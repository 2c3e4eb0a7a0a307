"""`deepspeed.runtime.pipe.engine`: `PipelineEngine`, what `initialize` returns for a `PipelineModule`."""

from zeroshard.pipe.engine import PipelineEngine

__all__ = ["PipelineEngine"]
