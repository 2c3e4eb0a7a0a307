"""`deepspeed.tp_model_init` and `set_autotp_mode`: AutoTP arguments given before `initialize`.

[Note: tp_model_init]
DeepSpeed 0.19.8's `tp_model_init(model, tp_size, dtype, tp_group=...)` splits nothing: it records its arguments
(process-wide, as DeepSpeed does; a second call must repeat them) and `initialize` merges them into the config's
`tensor_parallel` block: `autotp_size` is filled in from `tp_size` where the config has none, and a conflict is
refused: another `autotp_size`, a bf16/fp16 config of another dtype, a `tp_group` beside `initialize(mpu=...)`, a
`tp_group` whose size is not `tp_size`. zeroshard's AutoTP splits over its own mesh (consecutive ranks per
tensor-parallel group, [Note: tensor-parallel mesh]), so a `tp_group` must be that mesh's group of this rank; any
other is refused naming both. `set_autotp_mode(training=...)` (which `tp_model_init` calls) is recorded for
`is_autotp_training_mode()`: zeroshard's AutoTP layers are DTensor plans that train and evaluate alike, so the mode
changes nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.config import ZeroshardConfig
from zeroshard.errors import ConfigError


@dataclass(frozen=True)
class TpModelInit:
    tp_size: int
    dtype: torch.dtype | None
    tp_group: Any = None


class _Recorded:
    """The arguments of the process's `tp_model_init` calls ([Note: tp_model_init]); one per process."""

    def __init__(self) -> None:
        self.args: TpModelInit | None = None
        self.training = False

    def record(self, args: TpModelInit) -> None:
        if self.args is not None and (
            (self.args.tp_size, self.args.dtype) != (args.tp_size, args.dtype)
            or (self.args.tp_group is None) != (args.tp_group is None)
            or _size(self.args.tp_group) != _size(args.tp_group)
        ):
            raise ConfigError(
                f"tp_model_init(tp_size={args.tp_size}, dtype={args.dtype}) conflicts with an earlier call "
                f"(tp_size={self.args.tp_size}, dtype={self.args.dtype}); call it with the same arguments"
            )
        self.args = self.args or args


RECORDED = _Recorded()


def _size(group: Any) -> int | None:
    import torch.distributed as dist

    return None if group is None else dist.get_world_size(group=group)


def set_autotp_mode(training: bool = False) -> None:
    """DeepSpeed's AutoTP mode switch ([Note: tp_model_init]: recorded; it changes nothing in zeroshard's layers)."""
    RECORDED.training = bool(training)


def is_autotp_training_mode() -> bool:
    return RECORDED.training


def tp_model_init(
    model: nn.Module, tp_size: int, dtype: torch.dtype | None, config: Any = None, **kwargs: Any
) -> nn.Module:
    """Record AutoTP's arguments for `initialize`, which splits the model ([Note: tp_model_init]); returns `model`
    unchanged, as DeepSpeed's does.

    Example:
        >>> model = tp_model_init(model, tp_size=2, dtype=torch.bfloat16)  # doctest: +SKIP
    """
    unknown = sorted(set(kwargs) - {"tp_group"})
    if unknown:
        raise ConfigError(f"tp_model_init: unknown keyword arguments {unknown} (DeepSpeed's take tp_group)")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"tp_model_init(tp_size={tp_size!r}): expected a positive int")
    RECORDED.record(TpModelInit(tp_size, dtype, kwargs.get("tp_group")))
    set_autotp_mode(training=True)
    return model


def merged_block(raw: Mapping[str, Any], block: Mapping[str, Any] | None, mpu: Any) -> dict[str, Any] | None:
    """The `tensor_parallel` block with the recorded `tp_model_init` arguments merged in ([Note: tp_model_init]);
    `block` itself (None: none) without a call. `raw`: the whole config, for its precision."""
    args = RECORDED.args
    if args is None:
        return dict(block) if block is not None else None
    merged = dict(block or {})
    where = f"tp_model_init(tp_size={args.tp_size})"
    if args.tp_group is not None and mpu is not None:
        raise ConfigError(f"{where} was given tp_group; then initialize must not receive mpu= (DeepSpeed's rule)")
    if merged.get("autotp_size") not in (None, args.tp_size):
        raise ConfigError(f"tensor_parallel.autotp_size={merged['autotp_size']} conflicts with {where}; use one value")
    merged.setdefault("autotp_size", args.tp_size)
    configured = _config_dtype(raw)
    if configured is not None and args.dtype is not None and configured != args.dtype:
        raise ConfigError(f"the config trains in {configured} but {where} asked for dtype={args.dtype}; use one dtype")
    if args.tp_group is not None:
        _check_group(args.tp_group, args.tp_size, where)
    return merged


def with_tp_model_init(cfg: ZeroshardConfig, mpu: Any) -> ZeroshardConfig:
    """`cfg` with what `tp_model_init` recorded merged into `tensor_parallel` (`cfg` itself without a call)."""
    if RECORDED.args is None:
        return cfg
    block = merged_block(cfg.raw or {}, cfg.tensor_parallel, mpu)
    return dataclasses.replace(cfg, tensor_parallel=block, raw={**(cfg.raw or {}), "tensor_parallel": block})


def _config_dtype(raw: Mapping[str, Any]) -> torch.dtype | None:
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        block = raw.get(key)
        if isinstance(block, Mapping) and block.get("enabled") is True:
            return dtype
    return None


def _check_group(group: Any, tp: int, where: str) -> None:
    """The recorded tp_group is this rank's group of the autotp mesh."""
    import torch.distributed as dist

    from zeroshard.tp.mesh import TensorParallelGrid

    size = dist.get_world_size(group=group)
    if size != tp:
        raise ConfigError(f"{where}: its tp_group has {size} ranks; it must have tp_size")
    grid, rank = TensorParallelGrid(tp, dist.get_world_size()), dist.get_rank()
    want, got = grid.tp_ranks(grid.dp_index(rank)), sorted(dist.get_process_group_ranks(group))
    if got != want:
        raise ConfigError(
            f"{where}: rank {rank}'s tp_group is ranks {got}; zeroshard's AutoTP mesh groups consecutive ranks "
            f"({want} here): build tp groups of consecutive ranks or leave tp_group out"
        )


__all__ = ["is_autotp_training_mode", "set_autotp_mode", "tp_model_init"]
