"""Build the fsdp2 backend's strategy from a resolved config ([Note: fsdp2 mapping])."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ConfigError
from zeroshard.fsdp2.plan import plan_from_config, unused_keys
from zeroshard.fsdp2.strategy import Fsdp2Policy, Fsdp2Strategy
from zeroshard.loading.weights import StreamedWeights
from zeroshard.offload.tier import Tier
from zeroshard.tp.mesh import TensorParallelContext
from zeroshard.utils.logging import get_logger, log_rank
from zeroshard.zero.stage3.plan import NO_LEAVES, LeafModules
from zeroshard.zero.stepmath import StepPolicy
from zeroshard.zero.strategy import AccumulationState, ParamGroupSpec

logger = get_logger(__name__)


def build_fsdp2_strategy(
    cfg: Any,
    compute_dtype: torch.dtype,
    model: nn.Module,
    groups: list[ParamGroupSpec],
    comm: Collectives,
    device: torch.device,
    accumulation: AccumulationState,
    step: StepPolicy,
    weights: StreamedWeights | None,
    tp: TensorParallelContext | None = None,
    leaves: LeafModules = NO_LEAVES,
    init_source: int | None = None,
) -> Fsdp2Strategy:
    """The fsdp2 backend's strategy for `model` (checked against the config first: [Note: fsdp2 mapping]); with
    `tp`, FSDP2 over its data-parallel mesh dimension ([Note: tensor parallelism on fsdp2] in tp/fsdp2.py)."""
    plan = plan_from_config(cfg, compute_dtype)
    unused = unused_keys(dict(cfg.raw or {}))
    if unused:
        log_rank(
            logger,
            30,
            f"the fsdp2 backend does not use {', '.join(unused)}: the zero backend's bucket and stage-3 settings have "
            "no FSDP2 counterpart (it gathers one unit at a time and prefetches the next itself), and FSDP2 "
            "accumulates gradients in fp32 (docs/fsdp2.md)",
        )
    sparse = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse]
    if sparse:  # FSDP2's reduce-scatter copies gradients with an op that has no sparse kernel
        raise ConfigError(
            f"module {sparse[0]!r} has sparse=True: its sparse gradients cannot be reduce-scattered by FSDP2; use the "
            'zero backend (zeroshard.backend "zero", which makes them dense: [Note: sparse gradients]) or sparse=False'
        )
    policy = Fsdp2Policy(
        compute_dtype=compute_dtype,
        grad_accum_dtype=torch.float32,
        comm_dtype=plan.reduce_dtype,
        overlap_comm=True,
        step=step,
        master_tier=Tier(torch.device("cpu") if plan.cpu_offload else device),
        plan=plan,
        weights=weights,
        init_source=init_source,
        mesh=tp.dp_mesh if tp is not None else None,
        leaves=leaves,
    )
    if tp is not None:
        from zeroshard.tp.fsdp2 import TensorParallelFsdp2Strategy

        strategy: Fsdp2Strategy = TensorParallelFsdp2Strategy(model, groups, policy, comm, device, accumulation, tp)
    else:
        strategy = Fsdp2Strategy(model, groups, policy, comm, device, accumulation)
    log_rank(
        logger,
        20,
        f"fsdp2 backend: fully_shard on {len(strategy.units)} units, reshard_after_forward="
        f"{plan.reshard_after_forward}, param_dtype={plan.param_dtype}, reduce_dtype={plan.reduce_dtype}, "
        f"cpu_offload={plan.cpu_offload}",
    )
    return strategy
