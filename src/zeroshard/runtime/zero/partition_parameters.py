"""`deepspeed.runtime.zero.partition_parameters`: the names scripts import from it (DeepSpeed-Chat and TRL import
`ZeroParamStatus`, which the `ds_status` of a stage-3 parameter holds: [Note: DeepSpeed's parameter attributes] in
zero/stage3/ds_param.py)."""

from zeroshard.zero.deepspeed_api import Init, register_external_parameter, unregister_external_parameter
from zeroshard.zero.stage3.ds_param import ZeroParamStatus
from zeroshard.zero.stage3.gathered import GatheredParameters

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
]
