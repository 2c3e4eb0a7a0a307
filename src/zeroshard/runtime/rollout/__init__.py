"""`deepspeed.runtime.rollout`: on-policy generation for RL and distillation trainers (DeepSpeed 0.19.8's module).

A trainer hands prompts to a `RolloutEngine` (`RolloutRequest`, `SamplingConfig`) and trains on the `RolloutBatch`
that comes back; `HybridEngineRollout` generates with the training engine's own model ([Note: rollout through the
training engine]); `ResponseTokenBatch` and `generalized_jsd_loss` turn a rollout into a distillation loss.

Example:
    >>> from zeroshard.runtime.rollout import RolloutConfig, build_rollout
    >>> rollout = build_rollout(RolloutConfig(), student_engine=engine, tokenizer=tokenizer)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from zeroshard.errors import ConfigError
from zeroshard.runtime.rollout.base import RolloutBatch, RolloutConfig, RolloutEngine, RolloutRequest, SamplingConfig
from zeroshard.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout
from zeroshard.runtime.rollout.opsd import JSDLossOutput, ResponseTokenBatch, generalized_jsd_loss

__all__ = [
    "HybridEngineRollout",
    "JSDLossOutput",
    "ResponseTokenBatch",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingConfig",
    "build_rollout",
    "generalized_jsd_loss",
]

ENGINES = ("hybrid_engine",)


def build_rollout(rollout_cfg: Any, student_engine: Any = None, tokenizer: Any = None, **kwargs: Any) -> RolloutEngine:
    """The rollout engine `rollout_cfg.engine` names, over the trainer's engine and tokenizer. Other keyword arguments
    are other backends' (a served model's path, as DeepSpeed's factory takes them) and unused by the hybrid engine."""
    name = rollout_cfg.engine
    if name not in ENGINES:
        raise ConfigError(f"Unknown rollout engine {name!r}; choose from {', '.join(repr(e) for e in ENGINES)}")
    if student_engine is None or tokenizer is None:
        raise ConfigError("build_rollout: the hybrid_engine rollout needs both student_engine and tokenizer")
    return HybridEngineRollout(engine=student_engine, tokenizer=tokenizer, cfg=rollout_cfg)
