"""`adapt_batch`: a load into another data-parallel degree keeps the checkpoint's global batch."""

from __future__ import annotations

import dataclasses

from zeroshard.checkpoint.format import CheckpointMetadata
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def adapt_batch(engine: CheckpointableEngine, meta: CheckpointMetadata) -> bool:
    """Keep the checkpoint's global batch on a new data-parallel degree by changing gradient accumulation.

    Returns whether gradient_accumulation_steps changed. Not done when the config pins train_batch_size
    (the user asked for that batch) or when the micro-batch times the replicas does not divide it. The replicas
    are those the config's batch counts (train_batch_size / (micro x accumulation)), not the ranks of the
    checkpoint's world: a tensor-parallel or pp x tp lane group holds tp ranks per replica.
    """
    cfg = engine.config
    saved = int(meta.batch["train_batch_size"])
    current = int(cfg.train_batch_size)
    if saved == current:
        return False
    if not engine.accumulation.managed:  # [Note: caller-owned windows]: the script sizes its windows itself
        log_rank(
            logger,
            30,
            f"global batch changes from {saved} (checkpoint) to {current}: with managed_gradient_accumulation false "
            "the script's windows decide it; gradient_accumulation_steps (the loss divisor) stays as configured",
        )
        return False
    micro = int(cfg.train_micro_batch_size_per_gpu)
    replicas = current // (micro * int(cfg.gradient_accumulation_steps))
    pinned = cfg.raw.get("train_batch_size") not in (None, "auto")
    if pinned or saved % (micro * replicas):
        why = "train_batch_size is set in the config" if pinned else f"{micro} x {replicas} replicas does not divide it"
        log_rank(logger, 30, f"global batch changes from {saved} (checkpoint) to {current}: {why}")
        return False
    gas = saved // (micro * replicas)
    refused = engine.strategy.window_change_refused(gas) if engine.strategy is not None else None
    if refused is not None:
        log_rank(logger, 30, f"global batch changes from {saved} (checkpoint) to {current}: {refused}")
        return False
    engine.config = dataclasses.replace(cfg, train_batch_size=saved, gradient_accumulation_steps=gas)
    engine.accumulation.gradient_accumulation_steps = gas  # the strategy reads the window from here
    batch = meta.batch
    before = saved // (int(batch["train_micro_batch_size_per_gpu"]) * int(batch["gradient_accumulation_steps"]))
    log_rank(
        logger,
        30,
        f"data-parallel replicas {before} -> {replicas}: gradient_accumulation_steps "
        f"{cfg.gradient_accumulation_steps} -> {gas} keeps the global batch at {saved}",
    )
    return True
