"""`deepspeed.checkpointing`: activation checkpointing with DeepSpeed's API and `activation_checkpointing` block.

`configure(mpu_, deepspeed_config=None, ...)` decides how a checkpointed function's inputs are kept until the
recompute ([Note: checkpointing settings], [Note: what is partitioned]); `checkpoint(fn, *args)` runs `fn`
keeping only its inputs. `zeroshard.initialize` configures it from the config's `activation_checkpointing`
block when the config has one. Hugging Face's `gradient_checkpointing_enable()` (torch.utils.checkpoint) works
under every ZeRO stage without this module; see docs/activation_checkpointing.md.

Example:
    >>> import torch
    >>> from zeroshard import checkpointing
    >>> checkpointing.configure(None, checkpoint_in_cpu=True)
    >>> layer = torch.nn.Linear(8, 8)
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> checkpointing.checkpoint(layer, x).sum().backward()
    >>> checkpointing.is_configured(), tuple(x.grad.shape)
    (True, (4, 8))
    >>> checkpointing.reset()
"""

from __future__ import annotations

import logging
from typing import Any

from zeroshard.checkpointing import rng
from zeroshard.checkpointing.context import CONTEXT, CheckpointStats, ModelParallel
from zeroshard.checkpointing.function import CheckpointFunction, checkpoint, non_reentrant_checkpoint
from zeroshard.checkpointing.rng import CudaRNGStatesTracker
from zeroshard.checkpointing.settings import CheckpointingSettings, from_block, with_overrides
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

__all__ = [
    "CheckpointFunction",
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "configure_from_config",
    "non_reentrant_checkpoint",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "partition_activations_in_checkpoint",
    "reset",
    "set_num_layers",
    "settings",
    "stats",
]


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Configure activation checkpointing: defaults, then `deepspeed_config`'s `activation_checkpointing` block
    (a path, a dict or a parsed config), then each keyword that is not None. `mpu_` (Megatron-style: model-parallel
    rank/size/group getters) is the group `partition_activations` splits over; None keeps the previous one."""
    from zeroshard.config.parse import parse_config  # the config package imports much; only configure needs it

    base = CheckpointingSettings()
    if deepspeed_config is not None:
        base = from_block(parse_config(deepspeed_config).activation_checkpointing)
    chosen = with_overrides(
        base,
        partition_activations=partition_activations,
        contiguous_memory_optimization=contiguous_checkpointing,
        number_checkpoints=num_checkpoints,
        cpu_checkpointing=checkpoint_in_cpu,
        synchronize_checkpoint_boundary=synchronize,
        profile=profile,
    )
    if mpu_ is not None:
        CONTEXT.mpu = mpu_
    CONTEXT.model_parallel = ModelParallel.of(CONTEXT.mpu)
    CONTEXT.settings = chosen
    CONTEXT.buffers.release()
    CONTEXT.configured = True
    if chosen.partition_activations and CONTEXT.model_parallel.size == 1:
        log_rank(
            logger,
            logging.INFO,
            "activation checkpointing: partition_activations without model parallelism keeps "
            "each input whole (data-parallel ranks hold different activations; as DeepSpeed)",
        )
    log_rank(
        logger, logging.INFO, f"activation checkpointing: {chosen}, model-parallel size {CONTEXT.model_parallel.size}"
    )


def is_configured() -> bool:
    """True once `configure` has run (DeepSpeed's meaning)."""
    return CONTEXT.configured


def reset() -> None:
    """Drop the contiguous buffers and counters (DeepSpeed: call after forwards without backward, e.g. eval)."""
    CONTEXT.buffers.release()
    CONTEXT.stats = CheckpointStats()


def settings() -> CheckpointingSettings:
    return CONTEXT.settings


def stats() -> CheckpointStats:
    """Bytes of checkpointed inputs kept now and at most, and (with `profile`) time per phase."""
    return CONTEXT.stats


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """One setting, as DeepSpeed's setter assigns one global: checkpointing is no more configured than it was."""
    _set(partition_activations=partition_activation)


def set_num_layers(nlayers: int) -> None:
    """`number_checkpoints`, as DeepSpeed's setter assigns it: checkpointing is no more configured than it was."""
    _set(number_checkpoints=nlayers)


def _set(**setting: Any) -> None:
    CONTEXT.settings = with_overrides(CONTEXT.settings, **setting)
    CONTEXT.buffers.release()  # sized by the settings


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return CONTEXT.rng_tracker


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default stream with `seed` and the model-parallel one with `seed + 2718 + tp_rank` (Megatron)."""
    rng.seed_model_parallel(CONTEXT.rng_tracker, seed, ModelParallel.of(CONTEXT.mpu).rank)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    import torch

    with CONTEXT.rng_tracker.fork():
        value = seed + 2718 + ModelParallel.of(CONTEXT.mpu).rank
        torch.cuda.manual_seed(value) if torch.cuda.is_available() else torch.manual_seed(value)


def configure_from_config(cfg: Any, mpu: Any = None) -> None:
    """`zeroshard.initialize`: a config with an `activation_checkpointing` block configures checkpointing, over the
    mpu given to initialize (`partition_activations` splits over its model-parallel group). DeepSpeed's engine
    leaves this to the script (Megatron calls `deepspeed.checkpointing.configure(mpu, deepspeed_config=...)`); a
    later `configure` call still wins."""
    if "activation_checkpointing" in (cfg.raw or {}):
        configure(mpu, deepspeed_config=cfg)


def _module_globals() -> None:
    """DeepSpeed's module globals on this module ([Note: checkpointing module globals])."""
    import sys

    from zeroshard.checkpointing.globals import CheckpointingModule

    sys.modules[__name__].__class__ = CheckpointingModule


_module_globals()
