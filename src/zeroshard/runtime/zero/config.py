"""`deepspeed.runtime.zero.config.ZeroStageEnum`: DeepSpeed's names of the ZeRO stages. Scripts import it with
`deepspeed.runtime.fp16.loss_scaler.LossScaler` to allow-list both for `torch.load(weights_only=True)` of DeepSpeed
checkpoints (`torch.serialization.add_safe_globals`); zeroshard's checkpoints pickle neither.

Example:
    >>> ZeroStageEnum(3) is ZeroStageEnum.weights, int(ZeroStageEnum.max_stage)
    (True, 3)
"""

from enum import Enum


class ZeroStageEnum(int, Enum):
    """The ZeRO stages by what each one partitions, as DeepSpeed numbers them."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # an alias of `weights`, as in DeepSpeed


__all__ = ["ZeroStageEnum"]
