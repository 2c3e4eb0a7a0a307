"""Pipeline parallelism with DeepSpeed's API (`deepspeed.pipe`), on `torch.distributed.pipelining`.

`PipelineModule` splits a list of layers into stages; `zeroshard.initialize(model=PipelineModule(...))` returns a
`PipelineEngine` (zeroshard.pipe.engine) whose `train_batch()` runs one optimizer step over
`gradient_accumulation_steps` micro-batches (README, "When data parallelism is not enough").
"""

from zeroshard.pipe.layers import LayerSpec, TiedLayerSpec
from zeroshard.pipe.mesh import PipeGrid
from zeroshard.pipe.module import PipelineModule
from zeroshard.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeGrid",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
]
