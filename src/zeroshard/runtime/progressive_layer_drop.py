"""`deepspeed.runtime.progressive_layer_drop`: the schedule of Progressive Layer Dropping.

[Note: progressive layer drop]
PLD (Zhang and He, "Accelerating Training of Transformer-Based Language Models with Progressive Layer Dropping",
arXiv 2010.13369) skips transformer layers at random during training, more of them as training goes on. The model
does the dropping; the engine keeps its schedule, the keep probability theta(t) = (1 - theta_bar) exp(-gamma t) +
theta_bar, and hands it over as it did in DeepSpeed up to 0.18 (0.19 removed the feature):
- every forward in training mode gets the keyword arguments `progressive_layer_drop=True, pld_theta=theta`, so a
  module whose forward does not take them fails with a TypeError, as under DeepSpeed;
- on each accumulation boundary, before the optimizer step, theta is set from the steps taken so far, so after
  the i-th step (counting from 0) `engine.get_pld_theta()` is theta(i), and the first step's forwards see 1.0.
The schedule is a function of the step count alone, so a resumed run (global_steps restored) continues it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


class ProgressiveLayerDrop:
    """theta(t) = (1 - theta) exp(-gamma t) + theta: the keep probability PLD schedules ([Note: progressive layer
    drop]).

    Example:
        >>> pld = ProgressiveLayerDrop(theta=0.5, gamma=0.001)
        >>> pld.update_state(1000)
        >>> round(pld.get_theta(), 4)
        0.6839
    """

    def __init__(self, theta: float = 0.5, gamma: float = 0.001):
        self.theta = theta
        self.gamma = gamma
        self.current_theta = 1.0
        log_rank(logger, 20, f"progressive layer dropping enabled (theta = {theta}, gamma = {gamma})")

    def get_state(self) -> dict[str, Any]:
        """The keyword arguments each training forward gets."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        self.current_theta = (1.0 - self.theta) * float(np.exp(-self.gamma * global_step)) + self.theta
