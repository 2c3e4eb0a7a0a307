"""`deepspeed.runtime.data_pipeline.data_routing` (DeepSpeed's random layerwise token dropping, random-LTD) is not
provided: importing it raises one line that says so, where it failed with a bare ModuleNotFoundError."""

raise ModuleNotFoundError(  # (a script's `except ModuleNotFoundError` still takes it)
    "deepspeed.runtime.data_pipeline.data_routing (DeepSpeed's random-LTD token dropping) is not provided by "
    "zeroshard, nor the `data_efficiency.data_routing` config block; train without it (docs/compat.md)"
)
