"""Training schedules the engine drives: `progressive_layer_drop` and the legacy top-level `curriculum_learning`.

Both were removed in DeepSpeed 0.19 (its config refuses them); the facts are DeepSpeed 0.18's runtime/constants.py,
runtime/data_pipeline/config.py and engine.py. zeroshard keeps them for the scripts that still use them
(bing_bert's PLD, Megatron-DeepSpeed's seqlen curriculum): runtime/progressive_layer_drop.py and
runtime/data_pipeline/curriculum_scheduler.py do the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.config.fields import Bool, ConfigBlock, Float, Int, ListOf, Nullable, Str, block, option
from zeroshard.errors import ConfigError

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")


@dataclass(frozen=True)
class ProgressiveLayerDropConfig(ConfigBlock):
    """`progressive_layer_drop`: the keep-probability schedule of Progressive Layer Dropping (removed in DeepSpeed
    0.19)."""

    enabled: bool = option(False, "Pass progressive_layer_drop and pld_theta to every training forward.", Bool())
    theta: float = option(1.0, "The keep probability the schedule falls to (theta-bar).", Float(0.0, 1.0))
    gamma: float = option(0.001, "How fast it falls: exp(-gamma x step).", Float(minimum=0.0))


@dataclass(frozen=True)
class CurriculumScheduleConfig(ConfigBlock):
    """`curriculum_learning.schedule_config`: the keys its schedule_type reads."""

    total_curriculum_step: int | None = option(
        None, "fixed_linear/fixed_root: steps from min_difficulty to max_difficulty.", Nullable(Int(minimum=1))
    )
    difficulty_step: int | None = option(
        None, "fixed_linear/fixed_root: every difficulty is a multiple of this.", Nullable(Int(minimum=1))
    )
    root_degree: float | None = option(None, "fixed_root: 2 is a square root.", Nullable(Float(positive=True)))
    difficulty: tuple[int, ...] = option((), "fixed_discrete: the difficulties in order.", ListOf(Int(minimum=1)))
    max_step: tuple[int, ...] = option(
        (), "fixed_discrete: the last step of each difficulty but the last.", ListOf(Int(minimum=0))
    )


@dataclass(frozen=True)
class CurriculumLearningConfig(ConfigBlock):
    """`curriculum_learning` (legacy, top level; removed in DeepSpeed 0.19): a difficulty that grows with the
    step; with curriculum_type "seqlen" every training forward gets `curriculum_seqlen`."""

    enabled: bool = option(False, "Schedule a difficulty by step.", Bool())
    curriculum_type: str = option("seqlen", 'What the difficulty is ("seqlen" reaches the forward).', Str())
    min_difficulty: int | None = option(None, "The first difficulty.", Nullable(Int(minimum=1)))
    max_difficulty: int | None = option(None, "The last difficulty.", Nullable(Int(minimum=1)))
    schedule_type: str | None = option(None, "How it grows: " + ", ".join(SCHEDULE_TYPES) + ".", Nullable(Str()))
    schedule_config: CurriculumScheduleConfig = block(CurriculumScheduleConfig, "The schedule's parameters.")


def check_curriculum(cfg: CurriculumLearningConfig) -> None:
    """The keys an enabled curriculum's schedule needs (DeepSpeed's CurriculumScheduler asserts them), named."""
    if not cfg.enabled:
        return
    for key in ("min_difficulty", "max_difficulty", "schedule_type"):
        if getattr(cfg, key) is None:
            raise ConfigError(f"curriculum_learning.{key} is required when curriculum_learning.enabled is true")
    assert cfg.min_difficulty is not None and cfg.max_difficulty is not None
    if cfg.min_difficulty > cfg.max_difficulty:
        raise ConfigError(
            f"curriculum_learning.min_difficulty {cfg.min_difficulty} is above max_difficulty {cfg.max_difficulty}"
        )
    kind, schedule = cfg.schedule_type, cfg.schedule_config
    if kind not in SCHEDULE_TYPES:
        raise ConfigError(f"curriculum_learning.schedule_type: {kind!r} is not one of {', '.join(SCHEDULE_TYPES)}")
    needed = {
        "fixed_linear": ("total_curriculum_step", "difficulty_step"),
        "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
        "fixed_discrete": ("difficulty", "max_step"),
        "custom": (),
    }[kind]
    for key in needed:
        if getattr(schedule, key) in (None, ()):
            raise ConfigError(f"curriculum_learning.schedule_config.{key} is required by schedule_type {kind!r}")
    if kind == "fixed_discrete" and len(schedule.difficulty) != len(schedule.max_step) + 1:
        raise ConfigError(
            "curriculum_learning.schedule_config: difficulty needs one entry more than max_step (the last "
            f"difficulty holds from then on); got {len(schedule.difficulty)} and {len(schedule.max_step)}"
        )
