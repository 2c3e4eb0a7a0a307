"""`deepspeed.checkpointing` (activation checkpointing) is not provided yet: importing it says which issue brings it."""

raise ImportError(
    "zeroshard.checkpointing: DeepSpeed's activation-checkpointing API is not implemented yet; it comes with "
    "issue 17 (activation checkpointing). Meanwhile use torch.utils.checkpoint.checkpoint (see docs/compat.md)."
)
