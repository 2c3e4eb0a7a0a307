"""`deepspeed.runtime.zero.offload_states.get_state_devices`: where one kind of an engine's state lives now (RL
frameworks check it around `engine.offload_states()` / `reload_states()`: [Note: offloaded states])."""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.errors import ZeroshardError
from zeroshard.offload.states import OffloadDeviceEnum, OffloadStateTypeEnum, offload_kinds

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "get_state_devices"]


def get_state_devices(model: Any, state: Any) -> set[torch.device]:
    """The devices `state` (an `OffloadStateTypeEnum` kind, or its name) of the engine `model` is on: the host while
    `offload_states()` holds it away, else its tensors' devices (the host where the config keeps it there:
    `offload_optimizer`, stage 3's `offload_param`); empty where the engine has none of it (no gradient buckets yet).

    Example:
        >>> engine.offload_states(include=[OffloadStateTypeEnum.optim_states])  # doctest: +SKIP
        >>> get_state_devices(engine, OffloadStateTypeEnum.optim_states)  # doctest: +SKIP
        {device(type='cpu')}
    """
    (kind,) = offload_kinds(state)
    if model.strategy is None:
        raise ZeroshardError(
            "get_state_devices: the engine holds no training state (built without an optimizer, or destroyed)"
        )
    if model._offloader.holds(kind):
        return {torch.device("cpu")}
    return {tensor.device for tensor in model.strategy.offloadable().get(kind, [])}
