"""`deepspeed.runtime.data_pipeline.data_sampling` (DeepSpeed's data-efficiency sampler: `DeepSpeedDataSampler`,
data analysis, variable batch size and learning rate) is not provided: importing it raises one line that says so and
what to use instead, where it failed with a bare ModuleNotFoundError."""

raise ModuleNotFoundError(  # (a script's `except ModuleNotFoundError` still takes it)
    "deepspeed.runtime.data_pipeline.data_sampling (DeepSpeed's data-efficiency sampler, data analysis, variable "
    "batch size) is not provided by zeroshard, nor its `data_efficiency` config block; batch the data with your own "
    "DataLoader sampler, or use the legacy `curriculum_learning` block for a sequence-length curriculum "
    "(docs/compat.md)"
)
