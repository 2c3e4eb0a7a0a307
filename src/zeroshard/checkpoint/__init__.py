"""Sharded, crash-safe checkpoints with resharding at load, consolidation/export, and elasticity.

The engine methods (`Engine.save_checkpoint` / `Engine.load_checkpoint`) come from `CheckpointMixin`;
the format is described in docs/checkpoint.md and [Note: checkpoint format].

Example:
    >>> from zeroshard.checkpoint import convert_zero_checkpoint_to_fp32_state_dict
    >>> convert_zero_checkpoint_to_fp32_state_dict("ckpt", "hf_model")  # doctest: +SKIP
"""

from zeroshard.checkpoint import utils  # deepspeed.checkpoint.utils
from zeroshard.checkpoint.elasticity import ElasticityError, compute_elastic_config, elastic_batch_sizes
from zeroshard.checkpoint.engine_mixin import CheckpointMixin
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.export import (
    convert_main,
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from zeroshard.checkpoint.reshard import CheckpointReader
from zeroshard.checkpoint.sampler import ResumableDistributedSampler

__all__ = [
    "CheckpointError",
    "CheckpointMixin",
    "CheckpointReader",
    "ElasticityError",
    "ResumableDistributedSampler",
    "compute_elastic_config",
    "convert_main",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "elastic_batch_sizes",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "utils",
]
