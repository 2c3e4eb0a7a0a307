"""`deepspeed.runtime.pipe.topology`: the process topologies (DeepSpeed's `PipelineParallelGrid` is not provided:
the pipeline engine builds its own mesh from the topology, [Note: pipeline mesh])."""

from zeroshard.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    _prime_factors,
)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology", "_prime_factors"]
