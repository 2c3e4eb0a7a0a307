"""The checks of blocks that other parts of zeroshard read, run at `resolve_config`.

[Note: blocks checked by their readers]
Some blocks are read where they act, by pure functions that also check them: the opaque `tensor_parallel` and
`expert_parallel` blocks, `comms_logger.prof_ops`, NVMe offload's pool and aio sizes, `activation_checkpointing`
(DeepSpeed's assertions), `autotuning` (which `zeroshard autotune` reads), and what the fsdp2 backend cannot do.
`initialize` runs each before any work, but `zeroshard validate-config` builds no engine, so a config it called valid
could still be refused. `resolve_config`, which both call, runs the same functions here: the rule stays in one place,
its reader's module (imported here when resolving, since those modules import this package). What needs the model (the
`pipeline` block, which DeepSpeed reads only for a PipelineModule; MoE layers), the script's process (torch_autocast's
safe module classes, precision/policy.py `check_before_work`) or the launched world (`check_world`, which `initialize`
runs on the whole world and validate-config on `--world-size`) is checked where it is known.
"""

from __future__ import annotations

from typing import Any

from zeroshard.config.checks import zeropp_keys
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.errors import ConfigError


def check_blocks(cfg: ZeroshardConfig) -> None:
    """ConfigError for what a block's reader would refuse ([Note: blocks checked by their readers])."""
    from zeroshard.comm.comms_logger import check_prof_ops
    from zeroshard.moe.auto import autoep_of
    from zeroshard.tp.build import autotp_size, local_vocab_head_of, loss_parallel_of
    from zeroshard.tp.specs import partition_config_of
    from zeroshard.zero.from_config import check_nvme_sizes

    partition_config_of(dict(cfg.tensor_parallel or {}), autotp_size(cfg.tensor_parallel))
    loss_parallel_of(cfg.tensor_parallel)
    local_vocab_head_of(cfg.tensor_parallel)
    autoep_of(cfg.expert_parallel, quiet=True)
    check_prof_ops(cfg.comms_logger.prof_ops)
    check_nvme_sizes(cfg)
    if cfg.autotuning is not None:  # `zeroshard autotune` reads it; a typo or a wrong type is refused everywhere
        from zeroshard.autotuning.settings import from_block as autotuning_block

        autotuning_block(cfg.autotuning, tuner=False)  # (what DeepSpeed's engine accepts: not only the tuner's)
    if "activation_checkpointing" in (cfg.raw or {}):  # initialize configures checkpointing from it
        from zeroshard.checkpointing.settings import from_block

        from_block(cfg.activation_checkpointing).validate()
    if str(cfg.zeroshard.backend) == "fsdp2":
        import torch

        from zeroshard.fsdp2.plan import plan_from_config

        plan_from_config(cfg, torch.float32)


def check_world(cfg: Any, world_size: int) -> None:
    """What the launched world must satisfy, before any work: ZeRO++ hpZ's partitions tile it."""
    z = cfg.zero_optimization
    size = z.zero_hpz_partition_size
    on = "zero_hpz_partition_size" in zeropp_keys(z) and int(z.stage) == 3 and str(cfg.zeroshard.backend) == "zero"
    if on and world_size > 1 and world_size % int(size):
        raise ConfigError(
            f"zero_optimization.zero_hpz_partition_size {size} does not divide the {world_size} ranks; use a divisor "
            "of the world size (usually the GPUs per node)"
        )
