"""The ds_config mapped onto PyTorch FSDP2's policies, decided once and checked before anything is sharded. Pure.

[Note: fsdp2 mapping]
The `fsdp2` backend runs the same config and engine API on `torch.distributed.fsdp.fully_shard`:

- stage 3 -> `fully_shard(reshard_after_forward=True)` on every unit of zeroshard's own unit policy
  (zero/stage3/plan.py: the transformer blocks, then the root); stage 2 -> the same units with
  `reshard_after_forward=False` (parameters stay gathered from forward to backward, gradients are sharded).
  Stages 0 and 1 have no FSDP2 counterpart (FSDP2 always shards gradients): an error suggests stage 2 or the
  zero backend.
- bf16/fp16 -> `MixedPrecisionPolicy(param_dtype=<compute dtype>, reduce_dtype=fp32)`: FSDP2 keeps the sharded
  parameters in fp32 (they are the master weights) and reduces in fp32 unless `communication_data_type` names
  another dtype; gradients accumulate in fp32 like the zero backend's default `grad_accum_dtype`.
- `offload_param` and `offload_optimizer` both on "cpu" -> `CPUOffloadPolicy` (FSDP2 offloads parameters,
  gradients and optimizer state together); any other mix names both keys in the error; NVMe is refused.
- Gradient scaling, clipping, the fp16 loss scaler, optimizers and schedulers are zeroshard's own: FSDP2 is
  told to sum gradients (divided by `gradient_predivide_factor` or the world size exactly as
  [Note: pre- and post-scaling]), and the shared step skeleton of `Strategy.step` does the rest.
- The zero backend's tuning keys (buckets, stage 3's persistence, prefetch and reuse, sub-groups),
  `ignore_unused_parameters: false` (FSDP2 reduces a parameter without a gradient as zeros, where the zero backend's
  stages 1-2 refuse it) and a `data_types.grad_accum_dtype` other than fp32 have no FSDP2 counterpart:
  `unused_keys` names those the config sets (not "auto"), and the engine logs them in one warning line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.config.checks import zeropp_keys
from zeroshard.errors import ConfigError
from zeroshard.precision.dtypes import dtype_of


@dataclass(frozen=True)
class Fsdp2Plan:
    """What `fully_shard` is called with, and how gradients are reduced."""

    reshard_after_forward: bool
    param_dtype: torch.dtype | None  # None: compute in fp32 (no casting all-gather)
    reduce_dtype: torch.dtype
    cpu_offload: bool
    pin_memory: bool


def plan_from_config(cfg: Any, compute_dtype: torch.dtype) -> Fsdp2Plan:
    """[Note: fsdp2 mapping] from a resolved config; a `ConfigError` for what FSDP2 cannot do."""
    from torch.distributed.fsdp import FSDPModule  # 0.8 s of imports: only for the fsdp2 backend

    z = cfg.zero_optimization
    stage = int(z.stage)
    if not hasattr(FSDPModule, "set_custom_all_gather"):
        raise ConfigError(
            f'"zeroshard": {{"backend": "fsdp2"}} needs torch >= 2.8 (FSDP2\'s custom collectives, which count its '
            f'bytes); this is torch {torch.__version__}. Upgrade torch or use the "zero" backend.'
        )
    if stage < 2:
        raise ConfigError(
            f'"zeroshard": {{"backend": "fsdp2"}} runs ZeRO stages 2 and 3 (FSDP2 always shards gradients); '
            f"zero_optimization.stage is {stage}. Use stage 2 (the closest: optimizer state and gradients "
            'sharded, parameters whole between forward and backward) or the "zero" backend for stages 0/1.'
        )
    zeropp = zeropp_keys(z)
    if zeropp:
        raise ConfigError(
            f'zero_optimization.{", ".join(zeropp)} (ZeRO++) needs the "zero" backend: the fsdp2 backend\'s '
            'parameters and collectives are FSDP2\'s own. Remove the key or use the "zero" backend.'
        )
    param_dev, optim_dev = str(z.offload_param.device), str(z.offload_optimizer.device)
    if "nvme" in (param_dev, optim_dev):
        raise ConfigError(
            "the fsdp2 backend cannot offload to NVMe (zero_optimization.offload_param.device="
            f'{param_dev!r}, offload_optimizer.device={optim_dev!r}); use the "zero" backend for NVMe offload'
        )
    offload = param_dev == "cpu" and optim_dev == "cpu"
    if not offload and (param_dev == "cpu" or optim_dev == "cpu"):
        raise ConfigError(
            "FSDP2 offloads parameters, gradients and optimizer state together (CPUOffloadPolicy): set both "
            "zero_optimization.offload_param.device and zero_optimization.offload_optimizer.device to "
            f'"cpu", or neither (got offload_param.device={param_dev!r}, offload_optimizer.device={optim_dev!r}); '
            'the "zero" backend offloads them separately'
        )
    comm = cfg.communication_data_type
    return Fsdp2Plan(
        reshard_after_forward=stage == 3,
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
        reduce_dtype=dtype_of(comm) if comm else torch.float32,
        cpu_offload=offload,
        pin_memory=bool(z.offload_optimizer.pin_memory) and offload,
    )


# zero_optimization keys that tune the zero backend's buckets and stage-3 units: FSDP2 gathers one unit at a time and
# prefetches the next itself
ZERO_BACKEND_KEYS = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "round_robin_gradients",
    "sub_group_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)
_FP32_NAMES = ("fp32", "float32", "float", "torch.float32")


def unused_keys(raw: Any) -> list[str]:
    """The keys of the config as given (`cfg.raw`) that the fsdp2 backend does not use ([Note: fsdp2 mapping]):
    set, and not "auto" (an integration's placeholder, nothing the user chose).

    Example:
        >>> unused_keys({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size":
        ...     "auto"}, "data_types": {"grad_accum_dtype": "bf16"}})
        ['zero_optimization.reduce_bucket_size', 'data_types.grad_accum_dtype']
    """
    zero = raw.get("zero_optimization") if isinstance(raw, dict) else None
    zero = zero if isinstance(zero, dict) else {}
    found = [f"zero_optimization.{key}" for key in ZERO_BACKEND_KEYS if key in zero and zero[key] != "auto"]
    if zero.get("ignore_unused_parameters") is False:  # the zero backend's stages 1-2 refuse a parameter without a
        found.append("zero_optimization.ignore_unused_parameters")  # gradient; FSDP2 reduces it as zeros
    types = raw.get("data_types") if isinstance(raw, dict) else None
    accum = types.get("grad_accum_dtype") if isinstance(types, dict) else None
    if accum is not None and accum != "auto" and str(accum).lower() not in _FP32_NAMES:
        found.append("data_types.grad_accum_dtype")
    return found
