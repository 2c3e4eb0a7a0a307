"""`deepspeed.runtime.zero` (which `deepspeed.zero` also names): `zeroshard.zero`'s DeepSpeed names, and
`partition_parameters`, the module scripts import `ZeroParamStatus` from, and `offload_states.get_state_devices`."""

from zeroshard.runtime.zero import config, offload_config, offload_states, partition_parameters
from zeroshard.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)
from zeroshard.zero.deepspeed_api import unwrap_model_for_generation

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "config",
    "offload_config",
    "offload_states",
    "partition_parameters",
    "register_external_parameter",
    "unregister_external_parameter",
    "unwrap_model_for_generation",
]
