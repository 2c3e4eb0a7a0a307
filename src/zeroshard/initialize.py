"""`zeroshard.initialize`: DeepSpeed's entry point, building an Engine from a model and a ds_config."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from zeroshard import checkpointing
from zeroshard.autotuning.settings import engine_warning
from zeroshard.comm.collectives import Collectives, Scope
from zeroshard.comm.comms_logger import CommsLogger
from zeroshard.comm.same_setup import check_launched_world
from zeroshard.comm.topology import NodeLayout, Topology, init_distributed
from zeroshard.config import ZeroshardConfig, parse_config, resolve_config
from zeroshard.config.features import collective_timeout
from zeroshard.data import build_dataloader
from zeroshard.engine import Engine
from zeroshard.engine_optimizer import ScriptOptimizer
from zeroshard.errors import ConfigError
from zeroshard.fsdp2.plan import plan_from_config
from zeroshard.linear.engine import offload_base_weights, refuse_sharded_base_weights
from zeroshard.loading.agree import differing_start
from zeroshard.loading.broadcast import BROADCAST_BUCKET, broadcast_module_state
from zeroshard.loading.materialize import (
    materialize_adapters,
    materialize_buffers,
    materialize_parameters,
    share_with_saved_copies,
)
from zeroshard.loading.replay import forget as forget_recorded
from zeroshard.loading.weights import release, weights_for
from zeroshard.moe.auto import Surroundings, apply_autoep, autoep_of, refuse_combinations
from zeroshard.moe.zero import refuse_expert_stage3
from zeroshard.monitor import open_monitors
from zeroshard.offload.host_memory import apply_host_policy
from zeroshard.optim import as_deepspeed_builds, build_lr_scheduler, build_optimizer, optimizer_defaults
from zeroshard.optim.client import check_client_optimizer, class_built_by
from zeroshard.optim.lamb import Lamb, refuse_unplanned
from zeroshard.optim.regroup import config_groups
from zeroshard.optim.schedulers.base import steps_on_a_metric
from zeroshard.optim.state_dtype import keep_state_in
from zeroshard.pipe.build import build_pipe, pipe_dataloader
from zeroshard.pipe.context import dp_size
from zeroshard.precision.buffers import apply_buffer_dtypes
from zeroshard.precision.loss_scaler import build_loss_scaler
from zeroshard.precision.policy import PrecisionPolicy, check_before_work
from zeroshard.sequence.mesh import (
    build_sequence_parallel,
    is_sequence_mpu,
    refuse_with_sequence_parallel,
    sequence_degree,
    with_mesh_param,
)
from zeroshard.tp.build import autotp_mpu, build_tp, follow_split, tp_degree
from zeroshard.tp.mesh import TensorParallelContext
from zeroshard.tp.model_init import with_tp_model_init
from zeroshard.tp.same_batch import first_batch_check
from zeroshard.utils import groups as parallel_groups
from zeroshard.utils.logging import get_logger, log_rank
from zeroshard.zero.from_config import make_strategy
from zeroshard.zero.stage3.ds_param import unmark
from zeroshard.zero.stage3.pending import BUILT, refuse_open_block
from zeroshard.zero.strategy import AccumulationState, ParamGroupSpec, Strategy

logger = get_logger(__name__)

OptimizerArg = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    config_params: Mapping[str, Any] | None = None,
    backend: str | None = None,
    mesh_param: tuple[int, int] | None = None,
) -> tuple[Engine, ScriptOptimizer, Any, Any]:
    """Build the engine; returns `(engine, optimizer, training_dataloader, lr_scheduler)`.

    Runs as one process or under `torchrun`, starting torch.distributed itself (NCCL on CUDA, gloo on CPU). `backend`
    ("zero" or "fsdp2") overrides the config's `zeroshard.backend` (docs/fsdp2.md). `tensor_parallel.autotp_size` N
    splits a Llama/Qwen/Mistral-shaped HF model over N ranks, ZeRO over the rest; `mpu` (Megatron-style) gives the
    groups of a model the caller split (docs/tensor_parallel.md). `mesh_param` (data-parallel size, sequence-parallel
    size) is DeepSpeed's argument for the config's `data_parallel_size` and `sequence_parallel_size`.

    Example:
        >>> import torch, zeroshard
        >>> model = torch.nn.Linear(4, 4)
        >>> cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        ...        "zero_optimization": {"stage": 1}}
        >>> engine, opt, _, _ = zeroshard.initialize(model=model, config=cfg)  # doctest: +SKIP
        >>> loss = engine(torch.randn(2, 4)).sum(); engine.backward(loss); engine.step()  # doctest: +SKIP
    """
    if model is None:
        raise ConfigError("initialize(): model= is required")
    source = config if config is not None else config_params
    from_args = None
    if args is not None:  # --deepspeed_config (or the deprecated --deepscale_config) from add_config_arguments
        names = ("deepspeed_config", "deepscale_config", "zeroshard_config")
        from_args = next((getattr(args, n) for n in names if getattr(args, n, None)), None)
    if source is not None and from_args is not None:
        raise ConfigError(
            f"initialize(): a config came both from args ({from_args}) and from config=; pass only one, as "
            "DeepSpeed requires"
        )
    source = source if source is not None else from_args
    if source is None:
        raise ConfigError("initialize(): no config; pass config=<path to ds_config.json or a dict>")
    parsed = _with_backend(with_mesh_param(parse_config(source), mesh_param), backend)
    topology = init_distributed(timeout_s=collective_timeout(parsed.raw), required=dist_init_required)
    parsed = with_tp_model_init(parsed, mpu)  # [Note: tp_model_init]
    check_launched_world(parsed, model, mpu, topology.world_size)  # [Note: ranks given different setups]
    # a sequence-parallel mpu is not a tensor-parallel one ([Note: sequence parallelism])
    sp, sp_mpu = sequence_degree(parsed, mpu, topology.world_size), mpu if is_sequence_mpu(mpu) else None
    mpu = None if sp_mpu is not None else autotp_mpu(parsed, mpu)  # an mpu of the autotp mesh is autotp
    if sp > 1:
        refuse_with_sequence_parallel(parsed, model, mpu, sp)
    # the batch arithmetic counts data-parallel replicas: world_size / num_stages with a PipelineModule, and / the
    # tensor-parallel size ([Note: tensor-parallel mesh]), and / the sequence-parallel size
    dp = dp_size(model, topology.world_size) // tp_degree(parsed, mpu) // sp
    cfg = resolve_config(parsed, world_size=dp, known=_known_values(model, optimizer))
    if (autotuning := engine_warning(cfg.autotuning)) is not None:
        log_rank(logger, logging.WARNING, autotuning)
    if sp > 1:  # the step divides by the replicas; gradients travel in their own dtype
        cfg = dataclasses.replace(
            cfg, sequence_parallel_size=sp, communication_data_type=cfg.seq_parallel_communication_data_type
        )
    checkpointing.configure_from_config(cfg, mpu)
    parts = (model, optimizer, model_parameters, training_data, lr_scheduler, collate_fn)
    return _build(cfg, topology, *parts, mpu, sp_mpu)


def _with_backend(cfg: ZeroshardConfig, backend: str | None) -> ZeroshardConfig:
    """`initialize(backend=...)` overrides `zeroshard.backend`."""
    if backend is None:
        return cfg
    if backend not in ("zero", "fsdp2"):
        raise ConfigError(f'initialize(backend={backend!r}): expected "zero" or "fsdp2"')
    return dataclasses.replace(cfg, zeroshard=dataclasses.replace(cfg.zeroshard, backend=backend))


def _known_values(model: nn.Module, optimizer: OptimizerArg) -> dict[str, Any]:
    """Values that resolve "auto" config entries: the model's hidden size and the client optimizer's."""
    known: dict[str, Any] = {}
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if isinstance(hidden, int):
        known["hidden_size"] = hidden
    if isinstance(optimizer, torch.optim.Optimizer):
        for key, value in optimizer_defaults(optimizer).items():
            known[f"optimizer.params.{key}"] = value
    return known


def _build(
    cfg: ZeroshardConfig,
    topology: Topology,
    model: nn.Module,
    optimizer: OptimizerArg,
    model_parameters: Iterable[Any] | None,
    training_data: Any,
    lr_scheduler: Any,
    collate_fn: Callable[..., Any] | None,
    mpu: Any = None,
    sp_mpu: Any = None,
) -> tuple[Engine, ScriptOptimizer, Any, Any]:
    stage, sp = int(cfg.zero_optimization.stage), int(cfg.sequence_parallel_size or 1)
    check_before_work(cfg, model)  # autocast's safe module classes; a bf16 module DeepSpeed would train in bf16
    refuse_sharded_base_weights(model, stage, str(cfg.zeroshard.backend))  # [Note: sharded base weights]
    if isinstance(optimizer, torch.optim.Optimizer):  # before the model is sharded (a callable's: class_built_by)
        check_client_optimizer(optimizer, cfg)
    elif str(cfg.zeroshard.backend) != "fsdp2" and (built_class := class_built_by(optimizer)) is not None:
        check_client_optimizer(built_class, cfg, warn=False)
    if str(cfg.zeroshard.backend) == "fsdp2":  # refuse what FSDP2 cannot do before any work ([Note: fsdp2 mapping])
        plan_from_config(cfg, PrecisionPolicy.from_config(cfg).compute_dtype)
    z = cfg.zero_optimization
    offloads = str(z.offload_optimizer.device) != "none" or (stage == 3 and str(z.offload_param.device) != "none")
    autoep = autoep_of(cfg.expert_parallel)  # [Note: AutoEP]: refused combinations before any work
    if autoep is not None:
        has_optimizer = optimizer is not None or cfg.optimizer is not None
        offload, ranks = str(z.offload_optimizer.device), topology.world_size
        around = Surroundings(
            stage, str(cfg.zeroshard.backend), offload, ranks, tp_degree(cfg, mpu), sp, has_optimizer,
            bool(cfg.checkpoint.use_node_local_storage), bool(PrecisionPolicy.from_config(cfg).autocast_dtype),
        )  # fmt: skip
        refuse_combinations(autoep, around, model)
        if stage == 3 and autoep.size > 1:  # [Note: experts at stage 3]
            refuse_expert_stage3(z, model)
    # before the model is copied and sharded: [Note: glibc's mmap threshold]
    apply_host_policy(topology.device, churns=stage == 3 or offloads)
    # [Note: divergence check] fingerprints before every collective: on by default for stage 3 on gloo; on NCCL
    # the per-step gather digest and NCCL's watchdog catch divergence (ZEROSHARD_VERIFY_COLLECTIVES=1 forces it)
    verify_default = "1" if stage == 3 and topology.backend == "gloo" else "0"
    nodes = NodeLayout.from_env(topology.world_size)  # [Note: nodes]
    comm = Collectives(
        topology.group,
        topology.world_size,
        topology.rank,
        verify=os.environ.get("ZEROSHARD_VERIFY_COLLECTIVES", verify_default) == "1",
        logger=CommsLogger(cfg.comms_logger, topology.world_size, topology.rank),
        scope=Scope.INTER_NODE if nodes.nodes > 1 else Scope.INTRA_NODE,  # [Note: scopes]
    )
    monitors = open_monitors(cfg, comm, topology.rank, topology.device)  # before any work: [Note: monitors open first]
    world = comm
    sequence = build_sequence_parallel(sp, sp_mpu, world)  # [Note: sequence parallelism]
    if cfg.use_data_before_expert_parallelism:  # DeepSpeed's "D + E" expert groups ([Note: expert groups])
        from zeroshard.moe.zero import moe_layers

        for mesh_groups in dict.fromkeys(layer.groups for layer in moe_layers(model)):  # each once, module order
            mesh_groups.use_topology(True)
    # a PipelineModule: ZeRO runs over its stage's dp group ([Note: pipeline mesh]), the mpu's with tp ([Note: 3D mesh])
    pipe = build_pipe(cfg, model, comm, topology.device, mpu)
    if pipe is not None and cfg.torch_autocast.enabled:
        raise ConfigError("torch_autocast is not implemented for a PipelineModule (its stages run their own forward)")
    if pipe is not None and cfg.hybrid_engine.enabled:
        raise ConfigError(
            "hybrid_engine is not supported with a PipelineModule (DeepSpeed builds its pipeline engine and ignores "
            "the block); remove hybrid_engine or train a plain module"
        )
    if pipe is not None and not cfg.managed_gradient_accumulation:  # as DeepSpeed
        raise ConfigError(
            "managed_gradient_accumulation is false, which a PipelineModule does not support (train_batch runs the "
            "whole window); remove the key or set it true"
        )
    if pipe is not None:
        comm = pipe.dp_comm
    names = {id(p): n for n, p in model.named_parameters()}  # before a tensor-parallel split replaces them
    stages = pipe.groups.grid.stages if pipe is not None else 1
    tp = build_tp(cfg, model, world, topology.device, mpu, stages)  # split in place: [Note: tensor-parallel mesh]
    if tp is not None:
        comm = tp.dp_comm
        model_parameters = follow_split(model, names, optimizer, model_parameters)
    if cfg.checkpoint.use_node_local_storage and (pipe is not None or tp is not None):  # [Note: node-local ..]
        raise ConfigError(
            "checkpoint.use_node_local_storage is not supported with a PipelineModule or tensor parallelism (their "
            "checkpoints are written per stage or slice); save to a folder every node sees, or remove the key"
        )
    if pipe is not None and tp is not None:  # an mpu's split layers in a pipeline: [Note: 3D mesh]
        from zeroshard.pipe.three_d import compose

        compose(pipe, tp, mpu, model, topology.device)
    refuse_open_block(model)  # [Note: GatheredParameters before initialize]
    weights = weights_for(model)  # a model zero_init built from a checkpoint: [Note: streaming load]
    if weights is not None:
        weights.refuse_resized(model)
    if stage < 3 or str(cfg.zeroshard.backend) == "fsdp2":  # whole or FSDP2's parameters: no ZeRO-3 attributes
        unmark(list(model.parameters()))  # (zero_init set them: [Note: DeepSpeed's parameter attributes])
    meta = any(p.is_meta for p in model.parameters())
    if meta:  # PEFT's modules_to_save copies start from their originals' values
        share_with_saved_copies(model, weights)
    if stage < 3 and meta and weights is None:  # as DeepSpeed's zero.Init followed by a stage 0-2 config
        log_rank(
            logger,
            logging.WARNING,
            f"the model was built on the meta device (zero_init) and zero_optimization.stage is {stage}: every rank "
            "builds it whole from what its code recorded (stage 3 would shard it)",
        )
    # buffers are small and become real now (also when a GatheredParameters block before initialize made every
    # parameter real); stage 3 materialises parameters unit by unit
    if meta or any(b.is_meta for b in model.buffers()):
        materialize_buffers(model, weights, topology.device)
    if meta:  # PEFT's LoRA adapters of a meta base: lora_B zero, as PEFT initialises them
        materialize_adapters(model)
    if meta and stage == 3:  # [Note: one start on every rank]: what is whole on every rank now, as the first rank has
        # it (adapters, a head attached after zero_init, a constructor's real tensors; not what a block or a load
        # kept); stages 0-2 broadcast every parameter below
        whole, first = [p.data for p in model.parameters() if not p.is_meta and not BUILT.kept(p)], comm.global_rank(0)
        comm.broadcast_coalesced(
            whole, src=first, via=topology.device, label="zero_init start", bucket_bytes=BROADCAST_BUCKET
        )
        comm.broadcast_coalesced(list(model.buffers()), src=first, label="zero_init start")
    # stage 3 and fsdp2 replay zero_init's records on each rank: the rank whose values all take where they differ
    source = differing_start(model, comm, topology.device, weights) if meta and stage == 3 else None
    if autoep is not None:  # each rank keeps its experts (reads only their rows: [Note: AutoEP under zero_init])
        apply_autoep(model, autoep, bool(cfg.use_data_before_expert_parallelism))
    if stage < 3 and meta:  # each rank reads the whole checkpoint: it keeps every parameter
        materialize_parameters(model, weights, topology.device)
        meta = False
    if not meta:
        model.to(topology.device)
        broadcast_module_state(model, comm, src=tp.dp_root if tp is not None else pipe.dp_root if pipe else 0)
        offload_base_weights(model)  # LoRAConfig.offload_ratio ([Note: sharded base weights])
        if pipe is not None:
            pipe.sync_tied(model)
    precision = PrecisionPolicy.from_config(cfg)
    apply_buffer_dtypes(model, precision.compute_dtype, precision.buffer_dtype, precision.keep_in_fp32)
    groups = _param_groups(model, optimizer, model_parameters)
    if optimizer is None:  # Muon's halves, muP's width groups ([Note: muP on flat shards])
        groups = config_groups(cfg, groups, model, split=pipe is not None or tp is not None)
    has_optimizer = optimizer is not None or cfg.optimizer is not None
    accumulation = AccumulationState(
        int(cfg.gradient_accumulation_steps or 1),
        communicate_every_micro_step=stage >= 2,
        managed=bool(cfg.managed_gradient_accumulation),
    )
    strategy = engine_optimizer = None
    if has_optimizer:
        model_parallel = pipe.model_parallel if pipe is not None else tp.tp_comm if tp is not None else None
        strategy = make_strategy(
            cfg, stage, precision, model, groups, comm, topology, accumulation, weights, model_parallel, tp, source
        )
        engine_optimizer = _make_optimizer(cfg, optimizer, strategy)
        keep_state_in(engine_optimizer, precision.optimizer_state_dtype)  # [Note: bf16 master weights]
        strategy.attach(engine_optimizer)
        if isinstance(engine_optimizer, Lamb) and engine_optimizer.plan is None:
            refuse_unplanned(engine_optimizer, f"this engine's {type(strategy).__name__}")
    elif stage == 3:  # inference (evaluation, generation) with sharded parameters, as DeepSpeed allows
        strategy = make_strategy(
            cfg, stage, precision, model, [], comm, topology, accumulation, weights, None, tp, source
        )
    else:  # parameters only: buffers follow [Note: buffer dtypes]
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(precision.compute_dtype)
    release(model)
    BUILT.forget(model)  # an engine has it now: blocks no longer see zero_init's pending parameters in it
    forget_recorded(model)  # every tensor of it is real: [Note: initialisation recorded under zero_init]
    scheduler = _make_scheduler(cfg, lr_scheduler, engine_optimizer)
    if steps_on_a_metric(scheduler):  # optim/schedulers/base.py: DeepSpeed's handed it the batch size as the metric
        log_rank(
            logger,
            logging.WARNING,
            f"lr_scheduler {type(scheduler).__name__} steps on a metric: engine.step() "
            "leaves it alone; call lr_scheduler.step(metric) after each evaluation (the Hugging Face Trainer does)",
        )
    fp16 = cfg.fp16
    loss_scaler = None
    if fp16.enabled:
        loss_scaler = build_loss_scaler(
            loss_scale=fp16.loss_scale,
            initial_scale_power=fp16.initial_scale_power,
            loss_scale_window=fp16.loss_scale_window,
            hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_loss_scale=fp16.min_loss_scale,
            zero_stage=stage,
        )
    loader = None
    replicas = tp.dp_comm if tp is not None else sequence.dp if sequence is not None else topology
    if training_data is not None and pipe is not None:
        loader = pipe_dataloader(training_data, cfg, pipe, collate_fn)
    elif training_data is not None:
        loader = build_dataloader(  # a data-parallel replica's ranks read the same batches
            training_data,
            int(cfg.train_micro_batch_size_per_gpu or 1),
            replicas.rank,
            replicas.world_size,
            collate_fn,
            drop_last=bool(cfg.dataloader_drop_last),
        )
    parts = (model, cfg, topology, comm, precision, strategy, accumulation, engine_optimizer, scheduler, loss_scaler)
    compute = tp.compute_context if tp is not None else None  # [Note: vocab-parallel loss] in tp/plan.py
    if cfg.hybrid_engine.enabled:  # [Note: hybrid engine]
        from zeroshard.hybrid_engine import HybridEngine, share_rank0_rng

        share_rank0_rng(world, topology.device)
        engine: Engine = HybridEngine(*parts, loader, compute, monitors)
    elif pipe is not None:
        from zeroshard.pipe.engine import PipelineEngine  # torch.distributed.pipelining loads only for a pipeline

        engine = PipelineEngine(*parts, loader, None, monitors, pipe=pipe)
    else:
        engine = Engine(*parts, loader, compute, monitors)
    engine.sequence, engine.mpu = sequence, mpu if mpu is not None else sp_mpu
    if cfg.hybrid_engine.enabled or engine.forward_communicates():
        from zeroshard.generation import install

        install(engine)  # [Note: generation at stage 3]
    if pipe is None and (check := first_batch_check(model, tp)) is not None:  # [Note: a tensor-parallel group ...]
        engine.first_forward_hooks.append(check)
    engine.collate_fn = collate_fn  # deepspeed_io's default, and the replica it reads for
    if pipe is not None:  # a pipeline's loader reads in order, as pipe_dataloader's
        engine.data_replica = (pipe.data_parallel_rank, pipe.data_parallel_size, False)
    else:
        engine.data_replica = (replicas.rank, replicas.world_size, True)
    publish_groups(model, comm, tp, sequence, mpu or sp_mpu)
    return engine, engine.optimizer, loader, scheduler  # [Note: the engine's optimizer]


def publish_groups(
    model: nn.Module, dp: Collectives, tp: TensorParallelContext | None, sequence: Any = None, mpu: Any = None
) -> None:
    """`deepspeed.utils.groups` answers for this engine from now on ([Note: groups follow the engine])."""
    from zeroshard.moe.zero import moe_layers

    experts = {m.expert_group_name: m.groups for m in moe_layers(model)}
    tp_comm = tp.tp_comm if tp is not None else None
    mpu = mpu if mpu is not None or tp is None else parallel_groups  # AutoTP's: the module, as DeepSpeed sets it
    parallel_groups.publish(parallel_groups.EngineGroups(dp, tp_comm, experts, sequence), mpu)


def _param_groups(
    model: nn.Module, optimizer: OptimizerArg, model_parameters: Iterable[Any] | None
) -> list[ParamGroupSpec]:
    """The trainable parameter groups, from the client optimizer, `model_parameters`, or the model."""
    names = {id(p): n for n, p in model.named_parameters()}
    if isinstance(optimizer, torch.optim.Optimizer):
        raw_groups = [dict(g) for g in optimizer.param_groups]
    elif model_parameters is None:
        raw_groups = [{"params": list(model.parameters())}]
    else:
        items = list(model_parameters)
        if items and all(isinstance(item, Mapping) for item in items):
            raw_groups = [dict(item) for item in items]
        else:
            raw_groups = [{"params": items}]
    groups: list[ParamGroupSpec] = []
    seen: set[int] = set()
    for i, group in enumerate(raw_groups):
        params = group.pop("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        named = []
        for p in params:
            if id(p) not in names:
                raise ConfigError(
                    f"parameter group {i} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the model passed to initialize"
                )
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((names[id(p)], p))
        groups.append(ParamGroupSpec(group, named))
    orphans = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if orphans:
        logger.warning("trainable parameters not in any optimizer group stay unchanged: %s", ", ".join(orphans[:8]))
    return groups


def _make_optimizer(cfg: ZeroshardConfig, optimizer: OptimizerArg, zero: Strategy) -> torch.optim.Optimizer:
    groups = zero.master_param_groups()
    if isinstance(optimizer, torch.optim.Optimizer):
        if any(len(s) for s in optimizer.state.values()):
            raise ConfigError(
                "the client optimizer already has state; pass a freshly constructed optimizer "
                "(load optimizer state with engine.load_checkpoint)"
            )
        if len(groups) == len(optimizer.param_groups) and not zero.regroups:
            for target, group in zip(optimizer.param_groups, groups, strict=True):
                target["params"] = group["params"]
        else:  # a split strategy has each user group once per part (in part order), options kept ([Note: split flat
            # strategies]): pairing them with the client's groups by position would swap options
            optimizer.param_groups.clear()
            for group in groups:
                optimizer.add_param_group(dict(group))
        optimizer.state.clear()
        return optimizer
    if callable(optimizer):
        built = optimizer(groups)
        check_client_optimizer(built, cfg)
        return built
    assert cfg.optimizer is not None
    return as_deepspeed_builds(build_optimizer(cfg.optimizer.type, cfg.optimizer.params, groups), cfg)


def _make_scheduler(cfg: ZeroshardConfig, lr_scheduler: Any, optimizer: torch.optim.Optimizer | None) -> Any:
    if lr_scheduler is not None:
        if isinstance(lr_scheduler, type) or (callable(lr_scheduler) and not hasattr(lr_scheduler, "step")):
            return lr_scheduler(optimizer)  # a class too, as DeepSpeed calls any callable (it had `step`: used as is)
        built_for = len(lr_scheduler.get_last_lr()) if hasattr(lr_scheduler, "get_last_lr") else None
        if optimizer is not None and built_for is not None and built_for != len(optimizer.param_groups):
            raise ConfigError(
                f"lr_scheduler was built over {built_for} optimizer group(s), and the engine's optimizer has "
                f"{len(optimizer.param_groups)} (MoE experts, tensor-parallel shards or torch_autocast's halves take "
                "groups of their own): pass lr_scheduler as a callable taking the optimizer, or configure it in the "
                "config's scheduler block"
            )
        return lr_scheduler
    if cfg.scheduler is not None and optimizer is not None:
        return build_lr_scheduler(cfg.scheduler.type, cfg.scheduler.params, optimizer)
    return None
