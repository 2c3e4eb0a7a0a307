"""`deepspeed.runtime.zero.offload_config`: the enums scripts pass to `engine.offload_states()` ([Note: offloaded
states] in offload/states.py)."""

from zeroshard.offload.states import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]
