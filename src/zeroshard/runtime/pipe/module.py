"""`deepspeed.runtime.pipe.module`: `PipelineModule` and its layer specs."""

from zeroshard.pipe.layers import LayerSpec, TiedLayerSpec
from zeroshard.pipe.module import PipelineModule

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
