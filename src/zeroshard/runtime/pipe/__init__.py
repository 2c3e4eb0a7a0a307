"""`deepspeed.runtime.pipe`: where DeepSpeed keeps its pipeline classes and where Megatron-DeepSpeed, GPT-NeoX and
DeepSpeed's own tests import them from (`runtime.pipe.topology`, `runtime.pipe.module`, `runtime.pipe.engine`);
the names are zeroshard.pipe's."""

from zeroshard.runtime.pipe import engine, module, topology
from zeroshard.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from zeroshard.runtime.pipe.topology import ProcessTopology

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "engine", "module", "topology"]
