"""`deepspeed.runtime.data_pipeline.curriculum_scheduler`: a difficulty (a sequence length, typically) that grows
with the step.

[Note: legacy curriculum learning]
The top-level `curriculum_learning` block (DeepSpeed up to 0.18; 0.19 removed it in favour of data_efficiency's
data sampler) schedules one number by the step. When training, each `engine.forward` first sets it for the step
about to be taken, `update_difficulty(global_steps + 1)`, and with curriculum_type "seqlen" passes it to the module
as the keyword argument `curriculum_seqlen` (a module that does not take it fails with a TypeError, as under
DeepSpeed); the pipeline engine sets it at each `train_batch` and passes nothing (its stages read
`engine.curriculum_scheduler_legacy`, as Megatron-DeepSpeed's do). Once the difficulty reaches max_difficulty it
stays there. Schedules, with s the step:
- fixed_linear / fixed_root: floor(min + (max - min) x (s / total_curriculum_step)^(1 / root_degree)), rounded
  down to a multiple of difficulty_step but not below the first multiple at or above min_difficulty, and at most
  max_difficulty (root_degree 1 for fixed_linear). The floor at min_difficulty is DeepSpeed 0.19's fix: 0.18 could
  answer 0, a zero-length sequence, when difficulty_step exceeds min_difficulty.
- fixed_discrete: difficulty[i] for the first i with s <= max_step[i]; the last difficulty after max_step[-1].
- custom: the function given to `engine.curriculum_scheduler_legacy.set_custom_get_difficulty`.
The difficulty is a function of the step count, so a resumed run (global_steps restored) continues it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from zeroshard.config.fields import json_mapping
from zeroshard.config.parse import build_block
from zeroshard.config.schedules import CurriculumLearningConfig, check_curriculum
from zeroshard.errors import ZeroshardError
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


class CurriculumScheduler:
    """The legacy curriculum's difficulty by step ([Note: legacy curriculum learning]); `config` is the
    `curriculum_learning` block (with or without its `enabled` key).

    Example:
        >>> s = CurriculumScheduler({"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
        ...                          "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8}})
        >>> [s.update_difficulty(step) for step in (1, 50, 100, 200)]
        [8, 32, 64, 64]
    """

    def __init__(self, config: Mapping[str, Any]):
        given = {**json_mapping(config, "curriculum_learning"), "enabled": True}
        block = build_block(CurriculumLearningConfig, given, "curriculum_learning", logger)
        check_curriculum(block)
        assert block.min_difficulty is not None and block.max_difficulty is not None
        self.min_difficulty: int = block.min_difficulty
        self.max_difficulty: int = block.max_difficulty
        self.schedule_type = str(block.schedule_type)
        self.schedule = block.schedule_config
        self.curriculum_type = block.curriculum_type
        self.current_difficulty: int = block.min_difficulty
        self.first_step = True  # DeepSpeed's pipeline engine resets activation shapes on the first step
        self.custom_get_difficulty: Callable[[int], int] | None = None

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        self.custom_get_difficulty = schedule_function

    def get_current_difficulty(self) -> int:
        return self.current_difficulty

    def set_current_difficulty(self, difficulty: int) -> None:
        self.current_difficulty = difficulty

    def get_state(self) -> dict[str, Any]:
        return {"current_difficulty": self.current_difficulty}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.current_difficulty = int(state["current_difficulty"])

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at `global_steps`."""
        if self.schedule_type == "fixed_discrete":
            return self._fixed_discrete(global_steps)
        if self.schedule_type == "fixed_linear":
            return self._fixed_root(global_steps, 1.0)
        if self.schedule_type == "fixed_root":
            assert self.schedule.root_degree is not None
            return self._fixed_root(global_steps, self.schedule.root_degree)
        if self.custom_get_difficulty is None:
            raise ZeroshardError(
                'curriculum_learning.schedule_type is "custom" but no schedule was given: call '
                "engine.curriculum_scheduler_legacy.set_custom_get_difficulty(fn) before training (fn maps the "
                "step to the difficulty)"
            )
        return int(self.custom_get_difficulty(global_steps))

    def update_difficulty(self, global_steps: int) -> int:
        """Move to `global_steps`' difficulty unless max_difficulty is reached; returns the current one."""
        if self.current_difficulty < self.max_difficulty:
            self.current_difficulty = self.get_difficulty(global_steps)
        return self.current_difficulty

    def _fixed_discrete(self, global_steps: int) -> int:
        difficulty, max_step = self.schedule.difficulty, self.schedule.max_step
        return next((d for d, last in zip(difficulty, max_step, strict=False) if global_steps <= last), difficulty[-1])

    def _fixed_root(self, global_steps: int, root_degree: float) -> int:
        total, step = self.schedule.total_curriculum_step, self.schedule.difficulty_step
        assert total is not None and step is not None
        low, high = self.min_difficulty, self.max_difficulty
        value = math.floor((float(global_steps) / total) ** (1.0 / root_degree) * (high - low) + low)
        value -= value % step
        return min(max(value, -(-low // step) * step), high)


def scheduler_from_config(config: CurriculumLearningConfig) -> CurriculumScheduler | None:
    """The engine's legacy curriculum scheduler, None when the block is off."""
    if not config.enabled:
        return None
    return CurriculumScheduler(config.to_dict(include_defaults=False))
