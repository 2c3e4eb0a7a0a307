"""`deepspeed.ops`: DeepSpeed's optimizer class names as constructors of the optimizers zeroshard builds.

zeroshard has no custom kernels; `ops.adam.FusedAdam(...)` returns the torch optimizer that ds_config
`"optimizer": {"type": "Adam", ...}` builds (see `optim/optimizers.py`, [Note: Adam implementation]), so a
script that constructs DeepSpeed's optimizer and passes it to `initialize` trains the same way as one that
names it in the config.
"""

from zeroshard.ops import adagrad, adam, lamb, lion

__all__ = ["adagrad", "adam", "lamb", "lion"]
