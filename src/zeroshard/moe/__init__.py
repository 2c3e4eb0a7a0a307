"""`deepspeed.moe` is not provided yet: importing it says which issue brings it."""

raise ImportError(
    "zeroshard.moe: mixture-of-experts layers are not implemented yet; they come with issue 18 (tensor, pipeline "
    "and expert parallelism composed with ZeRO). zeroshard trains with ZeRO data parallelism only (docs/compat.md)."
)
