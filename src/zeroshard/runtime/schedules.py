"""The schedules a training forward and step carry: Progressive Layer Dropping's theta ([Note: progressive layer
drop]) and the legacy curriculum's difficulty ([Note: legacy curriculum learning]). The engine asks this object
for a training forward's extra keyword arguments and tells it when a step is about to be taken."""

from __future__ import annotations

from typing import Any

from zeroshard.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler, scheduler_from_config
from zeroshard.runtime.progressive_layer_drop import ProgressiveLayerDrop


class TrainingSchedules:
    """PLD and the legacy curriculum of one engine (each None when its block is off)."""

    def __init__(self, pld: ProgressiveLayerDrop | None, curriculum: CurriculumScheduler | None):
        self.pld = pld
        self.curriculum = curriculum

    @classmethod
    def from_config(cls, config: Any) -> TrainingSchedules:
        block = config.progressive_layer_drop
        pld = ProgressiveLayerDrop(theta=block.theta, gamma=block.gamma) if block.enabled else None
        return cls(pld, scheduler_from_config(config.curriculum_learning))

    def forward_kwargs(self, global_steps: int) -> dict[str, Any]:
        """What a training-mode `engine.forward` adds to the module's keyword arguments (it moves the curriculum
        to the step about to be taken)."""
        out: dict[str, Any] = self.pld.get_state() if self.pld is not None else {}
        if self.curriculum is not None:
            difficulty = self.curriculum.update_difficulty(global_steps + 1)
            if self.curriculum.curriculum_type == "seqlen":
                out["curriculum_seqlen"] = difficulty
        return out

    def before_batch(self, global_steps: int) -> None:
        """The pipeline engine's `train_batch`: the curriculum moves, nothing reaches the stages' forwards."""
        if self.curriculum is not None:
            self.curriculum.update_difficulty(global_steps + 1)

    def before_step(self, global_steps: int) -> None:
        """On an accumulation boundary, before the optimizer step: PLD's theta for `global_steps` steps taken."""
        if self.pld is not None:
            self.pld.update_state(global_steps)
