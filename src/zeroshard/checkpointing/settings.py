"""What `configure` and the `activation_checkpointing` block decide, as one frozen value.

[Note: checkpointing settings] DeepSpeed's `configure(mpu_, deepspeed_config, partition_activations, ...)` starts
from the defaults, applies the config file's `activation_checkpointing` block, then each keyword that is not None.
`contiguous_memory_optimization` needs `partition_activations` and `number_checkpoints` (DeepSpeed asserts both).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from zeroshard.errors import ConfigError


@dataclass(frozen=True)
class CheckpointingSettings:
    """How `checkpoint` keeps the inputs of a checkpointed function between forward and recompute."""

    partition_activations: bool = False  # keep 1/N of each input across the model-parallel group
    contiguous_memory_optimization: bool = False  # copy the kept pieces into preallocated buffers
    number_checkpoints: int | None = None  # checkpoints per forward: the preallocated buffer count
    cpu_checkpointing: bool = False  # keep the inputs (or their pieces) in host memory
    synchronize_checkpoint_boundary: bool = False  # synchronize the device at each checkpoint boundary
    profile: bool = False  # time each checkpoint's forward and recompute+backward

    def validate(self) -> CheckpointingSettings:
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ConfigError(
                "activation_checkpointing.contiguous_memory_optimization needs partition_activations: "
                "contiguous checkpointing is only available with partitioned activations (as DeepSpeed)"
            )
        if self.contiguous_memory_optimization and not self.number_checkpoints:
            raise ConfigError(
                "activation_checkpointing.contiguous_memory_optimization needs number_checkpoints: "
                "the number of checkpoints per forward sizes the contiguous buffers"
            )
        return self


def from_block(block: Any) -> CheckpointingSettings:
    """The settings an `activation_checkpointing` config block (ActivationCheckpointingConfig) asks for."""
    return CheckpointingSettings(
        partition_activations=block.partition_activations,
        contiguous_memory_optimization=block.contiguous_memory_optimization,
        number_checkpoints=block.number_checkpoints,
        cpu_checkpointing=block.cpu_checkpointing,
        synchronize_checkpoint_boundary=block.synchronize_checkpoint_boundary,
        profile=block.profile,
    )


def with_overrides(settings: CheckpointingSettings, **overrides: Any) -> CheckpointingSettings:
    """[Note: checkpointing settings] keywords given (not None) replace the block's values."""
    return replace(settings, **{k: v for k, v in overrides.items() if v is not None}).validate()
