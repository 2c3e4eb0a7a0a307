"""`deepspeed.runtime.hybrid_engine`: `DeepSpeedHybridEngine` is zeroshard's `HybridEngine`, what `initialize` returns
with `hybrid_engine.enabled` ([Note: hybrid engine] in zeroshard/hybrid_engine.py)."""

from zeroshard.hybrid_engine import HybridEngine

DeepSpeedHybridEngine = HybridEngine

__all__ = ["DeepSpeedHybridEngine"]
