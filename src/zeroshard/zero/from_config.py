"""The ZeRO strategy a config asks for: step policy, where state lives (tiers, NVMe preflighted), and which class.

`initialize` calls `make_strategy` once it has the model, the parameter groups, the precision policy and the
process groups; everything here is read from the config (and the model's size, for the swap files)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zeroshard.comm.collectives import Collectives
from zeroshard.comm.topology import NodeLayout, Topology
from zeroshard.config import ZeroshardConfig
from zeroshard.errors import ConfigError
from zeroshard.loading.weights import StreamedWeights
from zeroshard.offload.tier import Tier, tier_for
from zeroshard.precision.policy import PrecisionPolicy
from zeroshard.tp.mesh import TensorParallelContext
from zeroshard.utils.logging import get_logger
from zeroshard.zero.flat.strategy import FlatPolicy, FlatStrategy
from zeroshard.zero.stage3.plan import LeafModules
from zeroshard.zero.stage3.prefetch import PrefetchPolicy
from zeroshard.zero.stage3.speculate import SpeculationPolicy
from zeroshard.zero.stage3.strategy import Stage3Policy, Stage3Strategy
from zeroshard.zero.stepmath import StepPolicy
from zeroshard.zero.strategy import AccumulationState, ParamGroupSpec, Strategy
from zeroshard.zero.zeropp import ZeroPPPolicy

logger = get_logger(__name__)


SWAP_ALIGN = 4096  # bytes a swap file is rounded up to (its O_DIRECT block)


def _nvme_bytes(cfg: ZeroshardConfig, model: nn.Module, world_size: int, precision: PrecisionPolicy) -> dict[str, int]:
    """Swap-file bytes this rank needs per NVMe path, 25% margin, one sum when the paths agree. offload_optimizer:
    per element this rank trains, its master and two moments (Adam's, the most a supported optimizer keeps) in their
    dtypes ([Note: bf16 master weights]), and at stage 3 its gradient shard (at most fp32: [Note: gradients on
    NVMe]); a frozen parameter has none of them, and a rank trains its 1/N of the others (at stage 3 too: [Note:
    frozen parameters at stage 3]). offload_param: the compute-dtype shard of every parameter. Each swap file
    is rounded up to 4 KiB: a unit's master and gradient shard, and each piece's two moments, per parameter tensor at
    most (nvme_files.py)."""
    z = cfg.zero_optimization
    tensors = len(list(model.parameters()))
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trained = trainable / world_size
    size = {dtype: torch.finfo(dtype).bits // 8 for dtype in (precision.compute_dtype, precision.master_dtype)}
    state = size[precision.master_dtype] if precision.optimizer_state_dtype is None else 4
    need: dict[str, int] = {}
    if str(z.offload_optimizer.device) == "nvme":
        per_element = size[precision.master_dtype] + 2 * state + (4 if z.stage == 3 else 0)
        need[str(z.offload_optimizer.nvme_path)] = int(1.25 * per_element * trained) + 4 * SWAP_ALIGN * tensors
    if str(z.offload_param.device) == "nvme" and z.stage == 3:  # ignored below stage 3 (config.checks.warn_ignored)
        path = str(z.offload_param.nvme_path)
        shards = int(1.25 * size[precision.compute_dtype] * total / world_size) + SWAP_ALIGN * tensors
        need[path] = need.get(path, 0) + shards
    return need


def check_nvme_sizes(cfg: ZeroshardConfig) -> None:
    """ConfigError for a pool or aio size of 0 where a block offloads to NVMe: 0 passes the schema, as in DeepSpeed's,
    but NVMe I/O needs one of each (run by `resolve_config` too: [Note: blocks checked by their readers])."""
    z, aio = cfg.zero_optimization, cfg.aio
    for key in ("offload_optimizer", "offload_param"):
        if str(getattr(z, key).device) != "nvme" or (key == "offload_param" and int(z.stage) != 3):
            continue  # (offload_param is ignored below stage 3, with a warning)
        sizes = {
            f"zero_optimization.{key}.buffer_count": getattr(z, key).buffer_count,
            "aio.block_size": aio.block_size,
        }
        sizes |= {"aio.queue_depth": aio.queue_depth, "aio.intra_op_parallelism": aio.intra_op_parallelism}
        for name, value in sizes.items():
            if int(value) < 1:
                raise ConfigError(f"{name} = {value}: NVMe offload ({key}.device nvme) needs at least 1")


def _nvme_store_factory(
    cfg: ZeroshardConfig, key: str, need: dict[str, int], buffer_count: int, pin: bool
) -> Callable[[], Any] | None:
    """None unless `zero_optimization.<key>.device` is "nvme"; else preflight its path now and return what
    builds the store (and its swapper) in the strategy."""
    from zeroshard.offload import NvmeSwapper, preflight
    from zeroshard.offload.residency import NvmeStateStore

    block = getattr(cfg.zero_optimization, key)
    if str(block.device) != "nvme":
        return None
    path = str(block.nvme_path)
    aio = cfg.aio
    check_nvme_sizes(cfg)
    # every rank of this node writes its own swap files under the path (same filesystem)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    preflight(path, need[path], key=f"zero_optimization.{key}.nvme_path", sharing_ranks=local_ranks)
    # staging for tensors the swapper cannot read/write in place: a block per request in flight (8 MiB by
    # default), not offload_param.buffer_size (that sizes parameter buffers, 400 MB each by default)
    buffer_bytes = max(int(aio.block_size) * int(aio.queue_depth), 1 << 20)

    def build() -> NvmeStateStore:
        return NvmeStateStore(NvmeSwapper(path, aio, buffer_count, buffer_bytes, pin))

    return build


def make_strategy(
    cfg: ZeroshardConfig,
    stage: int,
    precision: PrecisionPolicy,
    model: nn.Module,
    groups: list[ParamGroupSpec],
    comm: Collectives,
    topology: Topology,
    accumulation: AccumulationState,
    weights: StreamedWeights | None,
    model_parallel: Collectives | None = None,
    tp: TensorParallelContext | None = None,
    init_source: int | None = None,
) -> Strategy:
    """The strategy `cfg` asks for at `stage`: its step policy, the tiers its state lives on (NVMe paths preflighted
    now) and the class (flat stages 0-2, tensor-parallel or expert-split, stage 3, or the fsdp2 backend);
    `init_source`: the rank whose replayed initialisation every rank takes ([Note: one start on every rank])."""
    z = cfg.zero_optimization
    from zeroshard.moe.zero import ExpertSplitStrategy, expert_groups_of, refuse_expert_stage3

    expert_groups = expert_groups_of(model, stage, comm, str(z.offload_optimizer.device))  # None unless ep_size > 1
    if expert_groups is not None and stage == 3:  # before the NVMe preflight: [Note: experts at stage 3]
        refuse_expert_stage3(z, model)
    need = _nvme_bytes(cfg, model, topology.world_size, precision)
    step = StepPolicy(
        gradient_clipping=float(cfg.gradient_clipping or 0.0),
        prescale_gradients=bool(cfg.prescale_gradients),
        gradient_predivide_factor=float(cfg.gradient_predivide_factor),
        check_overflow=precision.check_overflow,
        skip_nonfinite_norm=_skips_nonfinite_norm(stage, precision, cfg),
        model_parallel=model_parallel,
        sum_over_ranks=str(cfg.gradient_allreduce_op) == "sum",
        compute_norm=z.compute_grad_norm is not False,
        sequence_parallel=int(cfg.sequence_parallel_size or 1),  # [Note: sequence parallelism]
    )
    offload = str(z.offload_optimizer.device) != "none"
    if str(cfg.zeroshard.backend) == "fsdp2":
        if expert_groups is not None:
            raise ConfigError("MoE layers train with the flat ZeRO backend (stages 1-2), not zeroshard.backend fsdp2")
        from zeroshard.fsdp2.build import build_fsdp2_strategy  # torch's FSDP2 internals load only when asked for

        dtype, device = precision.compute_dtype, topology.device
        leaves = leaf_modules(cfg, model)
        if precision.autocast_dtype is not None:
            _warn_fp32_reduction("zeroshard.backend fsdp2")
        return build_fsdp2_strategy(
            cfg, dtype, model, groups, comm, device, accumulation, step, weights, tp, leaves, init_source
        )
    common: dict[str, Any] = {
        "compute_dtype": precision.compute_dtype,
        "grad_accum_dtype": precision.grad_accum_dtype,
        "comm_dtype": precision.comm_dtype,
        "overlap_comm": bool(z.overlap_comm),
        "step": step,
        "master_tier": _tier(cfg, "offload_optimizer", need, topology.device),
        "master_dtype": precision.master_dtype,
    }
    if stage < 3:
        bucket = int(z.reduce_bucket_size)
        if stage >= 1:
            bucket = min(bucket, int(z.allgather_bucket_size))  # one bucket is both reduced and gathered
        flat = FlatPolicy(
            **common,
            stage=stage,
            bucket_numel=max(bucket, 1),
            use_reduce_scatter=bool(z.reduce_scatter),
            ignore_unused_parameters=bool(z.ignore_unused_parameters),
            param_align=_param_align(stage, bool(z.parameter_alignment), precision.compute_dtype),
        )
        if precision.autocast_dtype is not None and stage >= 1:  # [Note: torch autocast] in zero/flat/autocast.py
            split = tp is not None or expert_groups is not None or offload
            return _autocast_strategy(model, groups, flat, comm, topology, accumulation, precision, split)
        if tp is not None:  # [Note: tensor-parallel norm] in tp/zero.py
            from zeroshard.tp.zero import TensorParallelStrategy

            return TensorParallelStrategy(model, groups, flat, comm, topology.device, accumulation, tp.tp_comm)
        if expert_groups is not None:  # [Note: experts under ZeRO] in moe/zero.py
            return ExpertSplitStrategy(model, groups, flat, comm, topology.device, accumulation, expert_groups)
        return FlatStrategy(model, groups, flat, comm, topology.device, accumulation)
    if precision.autocast_dtype is not None:
        _warn_fp32_reduction("zero_optimization.stage 3")
    par = z.offload_param
    policy = Stage3Policy(
        **common,
        prefetch=PrefetchPolicy(
            bucket_numel=int(z.stage3_prefetch_bucket_size),
            max_live_numel=int(z.stage3_max_live_parameters or 0),
            max_reuse_distance=int(z.stage3_max_reuse_distance),
            log_invalidation=bool(z.log_trace_cache_warnings),
        ),
        persistence_threshold=int(z.stage3_param_persistence_threshold),
        model_persistence_threshold=int(z.stage3_model_persistence_threshold),
        leaves=leaf_modules(cfg, model),
        sub_group_numel=max(int(z.sub_group_size), 1),
        param_tier=_tier(cfg, "offload_param", need, topology.device),
        param_read_ahead=(
            int(par.buffer_count),
            min(int(par.max_in_cpu), int(par.buffer_count) * int(par.buffer_size)),
        ),
        weights=weights,
        init_source=init_source,
        root_by_module=bool(cfg.zeroshard.stage3_root_by_module),
        speculation=_speculation(cfg, step),
        resident_state=_resident_state(cfg),
        zeropp=ZeroPPPolicy(
            quantized_weights=bool(z.zero_quantized_weights),
            hpz_partition_size=int(z.zero_hpz_partition_size or 1),
            quantized_gradients=bool(z.zero_quantized_gradients),
            quantized_nontrainable_weights=bool(z.zero_quantized_nontrainable_weights),
            nodes=NodeLayout.from_env(topology.world_size),
        ),
    )
    if expert_groups is not None:  # [Note: experts at stage 3] in moe/stage3.py
        from zeroshard.moe.stage3 import ExpertStage3Strategy

        return ExpertStage3Strategy(model, groups, policy, comm, topology.device, accumulation)
    return Stage3Strategy(model, groups, policy, comm, topology.device, accumulation)


def _resident_state(cfg: ZeroshardConfig) -> frozenset[str]:
    """zero_optimization.save_muon_momentum_buffer_in_memory: Muon's momentum stays in host memory while the masters
    and the Adam half's moments swap to NVMe (only an NVMe optimizer tier swaps; elsewhere everything is in memory)."""
    optimizer = cfg.optimizer
    muon = optimizer is not None and isinstance(optimizer.type, str) and optimizer.type.lower() == "muon"
    swaps = str(cfg.zero_optimization.offload_optimizer.device) == "nvme"
    if muon and swaps and cfg.zero_optimization.save_muon_momentum_buffer_in_memory:
        return frozenset({"momentum_buffer"})
    return frozenset()


def _autocast_strategy(
    model: nn.Module,
    groups: list[ParamGroupSpec],
    flat: FlatPolicy,
    comm: Collectives,
    topology: Topology,
    accumulation: AccumulationState,
    precision: PrecisionPolicy,
    other_split: bool,
) -> Strategy:
    """[Note: torch autocast] stages 1-2: the lower-precision-safe modules' gradients reduced in the autocast dtype."""
    from zeroshard.precision.policy import safe_module_classes
    from zeroshard.zero.flat.autocast import AutocastSplitStrategy, lower_precision_params

    if other_split:
        raise ConfigError(
            "torch_autocast at stages 1-2 does not combine with offload_optimizer, tensor parallelism or MoE expert "
            "parallelism yet (stage 3 does, reducing in fp32)"
        )
    low = lower_precision_params(model, safe_module_classes(precision.safe_modules))
    assert precision.autocast_dtype is not None
    return AutocastSplitStrategy(
        model, groups, flat, comm, topology.device, accumulation, low, precision.autocast_dtype
    )


def _warn_fp32_reduction(where: str) -> None:
    logger.warning(
        f"zeroshard: torch_autocast with {where} reduces every gradient in fp32; lower_precision_safe_modules' "
        "lower-precision reduction is done at stages 0-2 (DeepSpeed sends those gradients in the autocast dtype)"
    )


def leaf_modules(cfg: ZeroshardConfig, model: nn.Module) -> LeafModules:
    """`zero_optimization.leaf_module` ([Note: leaf modules]); a name or suffix that matches no module of `model` gets
    one warning, as in DeepSpeed (a class may name a model that is not in use, so classes do not)."""
    block = cfg.zero_optimization.leaf_module
    leaves = LeafModules(tuple(block.classes), tuple(block.names), tuple(block.name_suffixes))
    missing = leaves.unmatched(model)
    if missing:
        logger.warning(
            f"zeroshard: zero_optimization.leaf_module names {missing}, which match no module of the model; they are "
            "left out (a name is a qualified name from model.named_modules(), a suffix the end of one)"
        )
    leaves.mark(model)
    return leaves


def _speculation(cfg: ZeroshardConfig, step: StepPolicy) -> SpeculationPolicy | None:
    """`offload_optimizer.super_offload` ([Note: speculative host steps]; config/checks.py refused what it cannot
    do): the host steps during backward, unless clipping makes every step wait for the norm."""
    block = cfg.zero_optimization.offload_optimizer
    if not bool(block.super_offload):
        return None
    if step.gradient_clipping > 0:
        logger.warning(
            "zeroshard: zero_optimization.offload_optimizer.super_offload steps the optimizer during backward only "
            f"without gradient clipping (gradient_clipping {step.gradient_clipping:g} scales every gradient by the "
            "norm of all of them, as in DeepSpeed's SuperOffload); the offloaded step runs after backward"
        )
        return None
    may_skip = step.check_overflow or step.skip_nonfinite_norm
    return SpeculationPolicy(cores_fraction=float(block.cpuadam_cores_perc), may_skip=may_skip)


def _param_align(stage: int, aligned: bool, dtype: torch.dtype) -> int:
    """zero_optimization.parameter_alignment: each parameter of a stage 1-2 flat buffer starts on a 16-byte boundary
    (DeepSpeed's `16 // gcd(16, element size)` elements); ignored at stages 0 and 3 (config/checks.warn_ignored)."""
    return 16 // math.gcd(16, torch.finfo(dtype).bits // 8) if aligned and stage in (1, 2) else 1


def _skips_nonfinite_norm(stage: int, precision: PrecisionPolicy, cfg: ZeroshardConfig) -> bool:
    """[Note: skipped steps] which configurations apply a step whose global gradient norm is inf/nan."""
    fp32 = precision.compute_dtype == torch.float32
    bf16_unchecked = precision.compute_dtype == torch.bfloat16 and not precision.check_overflow
    # DeepSpeed's stage 1 is its BF16_Optimizer (which skips) only with fp32 accumulation asked for, not offloaded
    accum = str(cfg.data_types.grad_accum_dtype or "").lower()
    bf16_optimizer = (
        accum in ("fp32", "float32", "float") and str(cfg.zero_optimization.offload_optimizer.device) != "cpu"
    )
    return not ((fp32 and stage == 0) or (bf16_unchecked and (stage == 2 or (stage == 1 and not bf16_optimizer))))


def _tier(cfg: ZeroshardConfig, key: str, need: dict[str, int], device: torch.device) -> Tier:
    """Where `zero_optimization.<key>` puts its state (an NVMe path is preflighted now); the optimizer's `ratio`
    splits it ([Note: partial offload]; config/checks.py allows a ratio < 1 only at stage 3 on the CPU)."""
    block = getattr(cfg.zero_optimization, key)
    store = _nvme_store_factory(cfg, key, need, int(block.buffer_count), bool(block.pin_memory))
    ratio = float(getattr(block, "ratio", 1.0))
    return tier_for(str(block.device), device, bool(block.pin_memory), store, ratio)
