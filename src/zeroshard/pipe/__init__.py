"""`deepspeed.pipe` is not provided yet: importing it says which issue brings it."""

raise ImportError(
    "zeroshard.pipe: pipeline parallelism (PipelineModule, LayerSpec) is not implemented yet; it comes with issue 18 "
    "(tensor, pipeline and expert parallelism composed with ZeRO). zeroshard trains with ZeRO data parallelism only "
    "(docs/compat.md)."
)
