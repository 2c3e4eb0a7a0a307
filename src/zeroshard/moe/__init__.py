"""Mixture of experts: `MoE` (DeepSpeed's `deepspeed.moe.layer.MoE`), top-1/top-2 gating, expert parallelism."""

from zeroshard.moe.gating import top1gating, top2gating
from zeroshard.moe.groups import ExpertGroups, ExpertMesh
from zeroshard.moe.layer import MoE

__all__ = ["ExpertGroups", "ExpertMesh", "MoE", "top1gating", "top2gating"]
