"""`deepspeed.runtime.zero.offload_config`: the enums scripts pass to `engine.offload_states()` ([Note: offloaded
states] in offload/states.py), and DeepSpeed's offload config classes (`runtime/zero/config.py`)."""

from zeroshard.offload.states import OffloadDeviceEnum, OffloadStateTypeEnum
from zeroshard.runtime.zero.config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
