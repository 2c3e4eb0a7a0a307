"""The engine attributes the checkpoint code reads and writes (the integration contract)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from zeroshard.comm.topology import Topology
from zeroshard.precision.policy import PrecisionPolicy

if TYPE_CHECKING:
    from zeroshard.checkpoint.torn import TornLoad
    from zeroshard.zero.strategy import AccumulationState, Strategy


class CheckpointableEngine(Protocol):
    module: nn.Module
    config: Any  # ZeroshardConfig
    topology: Topology
    precision: PrecisionPolicy
    strategy: Strategy | None
    accumulation: AccumulationState
    basic_optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    loss_scaler: Any
    training_dataloader: Any
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int
    _torn_load: TornLoad | None  # [Note: a torn load]
