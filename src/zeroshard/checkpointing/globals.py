"""DeepSpeed's `deepspeed.checkpointing` module globals, read and written through zeroshard's settings.

[Note: checkpointing module globals]
DeepSpeed keeps its activation-checkpointing configuration in module globals (`PARTITION_ACTIVATIONS`,
`CONTIGUOUS_CHECKPOINTING`, `num_layers`, `CPU_CHECKPOINT`, `SYNCHRONIZE`, `PROFILE_TIME`, `mpu`,
`deepspeed_checkpointing_enabled`); scripts and its own tests read them, and save and restore them around
`configure` calls. zeroshard keeps one settings object (`CONTEXT.settings`, [Note: checkpointing settings]), so the
module's class gets a property per global: reading gives the setting in force, writing changes it (the next
checkpointed forward uses it), as writing DeepSpeed's global does. A write is not validated on its own (a restore
writes one global at a time through combinations `configure` would refuse); `checkpoint` uses what is set.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from zeroshard.checkpointing.context import CONTEXT, ModelParallel


def _setting(field: str) -> property:
    def read(_module: types.ModuleType) -> Any:
        return getattr(CONTEXT.settings, field)

    def write(_module: types.ModuleType, value: Any) -> None:
        CONTEXT.settings = dataclasses.replace(CONTEXT.settings, **{field: value})
        CONTEXT.buffers.release()  # (contiguous buffers are sized by these settings)

    return property(read, write)


def _read_mpu(_module: types.ModuleType) -> Any:
    return CONTEXT.mpu


def _write_mpu(_module: types.ModuleType, value: Any) -> None:
    CONTEXT.mpu = value
    CONTEXT.model_parallel = ModelParallel.of(value)


def _read_enabled(_module: types.ModuleType) -> bool:
    return CONTEXT.configured


def _write_enabled(_module: types.ModuleType, value: bool) -> None:
    CONTEXT.configured = bool(value)


class CheckpointingModule(types.ModuleType):
    """The class of the `zeroshard.checkpointing` module ([Note: checkpointing module globals])."""

    PARTITION_ACTIVATIONS = _setting("partition_activations")
    CONTIGUOUS_CHECKPOINTING = _setting("contiguous_memory_optimization")
    num_layers = _setting("number_checkpoints")
    CPU_CHECKPOINT = _setting("cpu_checkpointing")
    SYNCHRONIZE = _setting("synchronize_checkpoint_boundary")
    PROFILE_TIME = _setting("profile")
    mpu = property(_read_mpu, _write_mpu)
    deepspeed_checkpointing_enabled = property(_read_enabled, _write_enabled)
