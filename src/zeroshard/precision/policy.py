"""Which dtype is used where, decided once from the config."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.errors import ConfigError
from zeroshard.precision.dtypes import dtype_of
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


@dataclass(frozen=True)
class PrecisionPolicy:
    """compute: parameters and activations; grad_accum: gradient accumulation and shards;
    comm: gradient reduction (DeepSpeed's default: the compute dtype); master: master weights, fp32 unless
    `bf16.bf16_master_weights_and_grads` / `fp16.fp16_master_weights_and_grads` ([Note: bf16 master weights] in
    optim/state_dtype.py); optimizer_state: the dtype optimizer state is kept in (fp32 with low-precision masters
    unless `bf16.bf16_optimizer_states`; None: the masters').

    check_overflow: skip the optimizer step when a gradient holds inf/nan. Always with fp16 (the loss
    scaler needs it); with bf16 when `bf16.check_grad_overflow` (DeepSpeed's default: true; DeepSpeed 0.19.8
    reads it in its stage 1-2 optimizer, while its stage-3 and stage-0 bf16 paths always skip); not in fp32
    (DeepSpeed's ZeRO 1-3 do skip an inf/nan global norm in fp32).
    """

    compute_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    comm_dtype: torch.dtype
    fp16: bool
    check_overflow: bool
    buffer_dtype: torch.dtype | None = None  # [Note: buffer dtypes] in precision/buffers.py
    keep_in_fp32: str | tuple[str, ...] = "auto"
    autocast_dtype: torch.dtype | None = None  # torch_autocast: the forward's ([Note: torch autocast])
    # torch_autocast beside bf16.enabled: the bf16 model's forward under autocast, nothing else changed
    forward_autocast: torch.dtype | None = None
    safe_modules: tuple[str, ...] | None = None  # torch_autocast.lower_precision_safe_modules (None: DeepSpeed's)
    master_dtype: torch.dtype = torch.float32
    optimizer_state_dtype: torch.dtype | None = None

    @classmethod
    def from_config(cls, cfg: Any) -> PrecisionPolicy:
        if cfg.fp16.enabled:
            compute = torch.float16
        elif cfg.bf16.enabled:
            compute = torch.bfloat16
        else:
            compute = torch.float32
        accum_name = cfg.data_types.grad_accum_dtype
        comm_name = cfg.communication_data_type
        buffer_name = cfg.data_types.buffer_dtype
        autocast = cfg.torch_autocast
        keep = cfg.data_types.keep_in_fp32_modules
        # [Note: bf16 master weights]: masters in the compute dtype; fp32 state unless bf16_optimizer_states
        low_master = bool(
            (cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads)
            or (cfg.fp16.enabled and cfg.fp16.fp16_master_weights_and_grads)
        )
        master = compute if low_master else torch.float32
        # DeepSpeedCPUAdam's fp32_optimizer_states false keeps its moments in the parameters' (masters') dtype
        ds_params = cfg.optimizer.params if cfg.optimizer is not None and cfg.optimizer.params else {}
        low_state = bool(cfg.bf16.enabled and cfg.bf16.bf16_optimizer_states)
        low_state = low_state or ds_params.get("fp32_optimizer_states") is False
        return cls(
            compute_dtype=compute,
            grad_accum_dtype=dtype_of(accum_name) if accum_name else master,
            comm_dtype=dtype_of(comm_name) if comm_name else compute,
            fp16=bool(cfg.fp16.enabled),
            check_overflow=bool(cfg.fp16.enabled or (cfg.bf16.enabled and cfg.bf16.check_grad_overflow)),
            buffer_dtype=dtype_of(buffer_name) if buffer_name else None,
            keep_in_fp32=keep if isinstance(keep, str) else tuple(keep),
            autocast_dtype=dtype_of(autocast.dtype or "bf16") if autocast.enabled and not cfg.bf16.enabled else None,
            forward_autocast=torch.bfloat16 if autocast.enabled and cfg.bf16.enabled else None,
            safe_modules=None
            if autocast.lower_precision_safe_modules is None
            else tuple(autocast.lower_precision_safe_modules),
            master_dtype=master,
            optimizer_state_dtype=torch.float32 if low_master and not low_state else None,
        )


def check_before_work(cfg: Any, model: nn.Module) -> None:
    """What the precision settings need from the model and the environment, before `initialize` does any work: the
    classes `torch_autocast.lower_precision_safe_modules` names import (at every stage, as DeepSpeed imports them at
    initialize), and `warn_module_dtype`."""
    if cfg.torch_autocast.enabled:
        safe_module_classes(cfg.torch_autocast.lower_precision_safe_modules)
    warn_module_dtype(cfg, model)


def warn_module_dtype(cfg: Any, model: nn.Module) -> None:
    """One warning, before any work, when a module in bf16 (fp16) meets a config that enables neither bf16 nor fp16:
    zeroshard casts it to fp32 (twice the memory; inputs in the module's dtype then fail at the first forward), where
    DeepSpeed's engine casts nothing and trains the module in its own dtype."""
    if cfg.fp16.enabled or cfg.bf16.enabled or cfg.torch_autocast.enabled:
        return
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    key = {frozenset({torch.bfloat16}): "bf16", frozenset({torch.float16}): "fp16"}.get(frozenset(dtypes))
    if key is not None:
        log_rank(
            logger,
            30,
            f"the module's parameters are all {key} and the config enables neither bf16 nor fp16: the module is cast "
            f'to fp32 (DeepSpeed trains it in {key}); set "{key}": {{"enabled": true}} to train it in {key}',
        )


DEFAULT_SAFE_MODULES = ("torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d")


def safe_module_classes(names: Sequence[str] | None) -> tuple[type, ...]:
    """The classes `torch_autocast.lower_precision_safe_modules` names (module path and class), DeepSpeed's four
    when None; one that cannot be imported is a ConfigError naming it."""
    classes = []
    for name in DEFAULT_SAFE_MODULES if names is None else names:
        module_name, _, class_name = name.rpartition(".")
        try:
            classes.append(getattr(importlib.import_module(module_name), class_name))
        except (ImportError, AttributeError, ValueError) as err:
            raise ConfigError(
                f"torch_autocast.lower_precision_safe_modules: cannot import {name!r} ({err}); give classes as "
                '"package.module.ClassName"'
            ) from None
    return tuple(classes)
