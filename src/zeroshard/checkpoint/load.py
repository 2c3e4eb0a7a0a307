"""`load_checkpoint`: each rank reads the ranges it owns under its current layout, from any layout.

Order of restoration (DeepSpeed's semantics):
- module weights always (strict key check per `load_module_strict`);
- `load_module_only`: nothing else; master weights are refreshed from the loaded module weights;
- otherwise counters, RNG, sampler position, the lr scheduler (`load_lr_scheduler_states`), and with
  `load_optimizer_states` the fp32 master weights, optimizer state and loss scaler (else the master
  weights are refreshed from the module weights, as DeepSpeed's `_restore_from_bit16_weights`).
When the world size changed, the global batch is kept by adapting gradient accumulation (unless the
config pins `train_batch_size`), see `adapt_batch`.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
from typing import Any

import torch

from zeroshard.checkpoint.batch import adapt_batch
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import (
    ENGINE_STATE_FILE,
    LATEST_FILE,
    MASTER,
    METADATA_FILE,
    CheckpointMetadata,
    rng_file,
)
from zeroshard.checkpoint.node_local import check_loadable, node_local, saved_by
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.checkpoint.reshard import MODEL, OPTIM, CheckpointReader
from zeroshard.checkpoint.rng import restore_rng_state
from zeroshard.checkpoint.safetensors_io import dtype_from_name
from zeroshard.checkpoint.save import (
    ModuleCatalog,
    catalog_module,
    compute_dtype_name,
    engine_state,
    full_shapes,
    peer_tensors,
)
from zeroshard.checkpoint.state import ModelPiece, ShardedState, StatePart
from zeroshard.checkpoint.sync import ENTRY_PHASE, RankSync, describe_errors, entry_timeout, write_timeout
from zeroshard.checkpoint.torn import load_scope, mark_torn, repaired
from zeroshard.checkpoint.universal import LATEST_UNIVERSAL, UniversalReader
from zeroshard.comm.topology import NodeLayout
from zeroshard.optim.state_dtype import state_dtype
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def resolve_tag_dir(load_dir: str, tag: str | None, latest_file: str = LATEST_FILE) -> str | None:
    """`<load_dir>/<tag>` (tag from `latest` when None); None when there is no `latest`."""
    if tag is None:
        latest = os.path.join(load_dir, latest_file)
        if not os.path.isfile(latest) and latest_file == LATEST_UNIVERSAL:
            raise CheckpointError(f"{latest}: missing (ds_to_universal writes it); pass tag= to name the checkpoint")
        if not os.path.isfile(latest):
            return None
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
    tag_dir = os.path.join(load_dir, str(tag))
    if os.path.isdir(tag_dir):
        return tag_dir
    # A crash between the two renames of a re-save leaves the complete old copy aside (see [Note: crash safety]).
    for old in sorted(glob.glob(os.path.join(glob.escape(load_dir), f".old.{glob.escape(str(tag))}.*"))):
        if os.path.isfile(os.path.join(old, METADATA_FILE)):
            log_rank(logger, 30, f"{tag_dir} is missing (a save of it was interrupted); using its old copy {old}")
            return old
    raise CheckpointError(f"{tag_dir}: checkpoint directory does not exist")


# -- module weights ------------------------------------------------------------------------------------
def _ckpt_name(meta: CheckpointMetadata, name: str, aliases: dict[str, str]) -> str | None:
    """The checkpoint's canonical name for the engine's tensor `name` (tied weights may be named apart)."""
    if name in meta.tensors:
        return name
    if name in meta.aliases:
        return meta.aliases[name]
    for alias, canonical in aliases.items():  # the engine calls it by another of its keys
        if canonical == name and alias in meta.tensors:
            return alias
    return None


def check_module_keys(meta: CheckpointMetadata, catalog: ModuleCatalog, strict: bool) -> dict[str, str]:
    """engine canonical name -> checkpoint name; missing/unexpected keys are errors when `strict`."""
    mapping: dict[str, str] = {}
    missing = []
    for name, tensor in catalog.tensors.items():
        ckpt = _ckpt_name(meta, name, catalog.aliases)
        if ckpt is None:
            if name not in meta.excluded:
                missing.append(name)
            continue
        saved = meta.tensors[ckpt].shape
        info = catalog.infos.get(name)
        shape = tuple(info.shape) if info is not None else tuple(tensor.shape)  # stage 3: full, not the placeholder
        if shape != tuple(saved):
            raise CheckpointError(f"{name}: shape {shape} in the model, {saved} in the checkpoint")
        mapping[name] = ckpt
    held_by_peers = set(catalog.infos) - set(catalog.tensors)  # ShardedState.peer_tensors
    unexpected = sorted(set(meta.tensors) - set(mapping.values()) - held_by_peers)
    if missing or unexpected:
        message = f"module keys differ from the checkpoint: missing {missing[:10]}, unexpected {unexpected[:10]}"
        if strict:
            raise CheckpointError(message + " (pass load_module_strict=False to load the rest)")
        log_rank(logger, 30, message)
    return mapping


def load_module_weights(
    reader: CheckpointReader, catalog: ModuleCatalog, state: ShardedState | None, mapping: dict[str, str]
) -> None:
    """Fill the module's tensors no strategy shards (`mapping`: engine -> checkpoint names, `check_module_keys`). The
    ranges of sharded ones are filled part by part (`fill_targets`, [Note: state parts])."""
    sharded = set(state.sharded_params().values()) if state is not None else set()
    targets = [
        ModelPiece(name, 0, tensor.numel(), tensor.detach())
        for name, tensor in catalog.tensors.items()
        if name not in sharded
    ]
    fill_targets(reader, targets, mapping)


def fill_targets(reader: CheckpointReader, targets: list[ModelPiece], mapping: dict[str, str]) -> None:
    with torch.no_grad():
        for target in targets:
            if target.name not in mapping:
                continue
            out = target.values
            if out.is_contiguous():
                reader.read_range(MODEL, mapping[target.name], target.begin, target.end, out.view(-1))
            else:
                flat = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
                reader.read_range(MODEL, mapping[target.name], target.begin, target.end, flat)
                out.copy_(flat.view(out.shape))


# -- optimizer ---------------------------------------------------------------------------------------------
def _scalar(record: dict[str, Any], like: Any, device: torch.device) -> Any:
    if record["tensor"] is None:
        return record["value"]
    if isinstance(like, torch.Tensor):
        device = like.device
    return torch.tensor(record["value"], dtype=dtype_from_name(record["tensor"]), device=device)


def _state_zeros(optimizer: torch.optim.Optimizer, param: torch.Tensor, saved: str) -> torch.Tensor:
    """Zeros for `param`'s elementwise state: in the dtype this engine keeps it in (floating state: the checkpoint may
    come from a run with other master or state dtypes, [Note: bf16 master weights]), else the checkpoint's."""
    dtype = dtype_from_name(saved)
    if dtype.is_floating_point:
        dtype = state_dtype(optimizer, param)
    return torch.zeros(param.shape, dtype=dtype, device=param.device)


def load_optimizer_state(
    reader: CheckpointReader,
    optimizer: torch.optim.Optimizer,
    part: StatePart,
    mapping: dict[str, str],
    load_master: bool,
    ckpt_group: dict[int, int],
) -> None:
    """Master weights (when `load_master`) and optimizer state of one part's pieces, scalars, group options.
    `ckpt_group` (this engine's group -> the checkpoint's) grows over the parts."""
    info = reader.metadata.optimizer
    assert info is not None
    group_of_name = {name: g for g, group in enumerate(info.groups) for name in group["params"]}
    kind_of = {id(param): _kind(group) for group in optimizer.param_groups for param in group["params"]}
    pieces = part.optim_pieces()
    elementwise: dict[int, dict[str, torch.Tensor]] = {}
    part.refresh_master()  # pieces the checkpoint lacks (non-strict loads) keep the module's values
    with torch.no_grad():
        for p in pieces:
            name = mapping.get(p.name)
            if name is None or not reader.has(OPTIM, name):
                continue  # its optimizer state starts from zeros
            ckpt_group.setdefault(p.group, group_of_name.get(name, p.group))
            if load_master:
                reader.read_range(OPTIM, name, p.begin, p.end, p.view(p.param), state=MASTER)
            saved_group = group_of_name.get(name)
            if saved_group is not None and _kind(info.groups[saved_group]["options"]) != kind_of.get(id(p.param)):
                continue  # [Note: optimizer state of another kind]
            tensors = elementwise.setdefault(id(p.param), {})
            for key, dtype in info.elementwise.items():
                if reader.has_state(OPTIM, name, key) is False:
                    continue  # another group's kind of state
                if key not in tensors:
                    tensors[key] = _state_zeros(optimizer, p.param, dtype)
                reader.read_range(OPTIM, name, p.begin, p.end, p.view(tensors[key]), state=key)
    for g, group in enumerate(optimizer.param_groups):
        source = ckpt_group.get(g, g)
        if source >= len(info.groups):
            log_rank(logger, 30, f"optimizer group {g} has no counterpart in the checkpoint; its state starts fresh")
            continue
        saved = info.groups[source]
        if _kind(saved["options"]) != _kind(group):  # [Note: optimizer state of another kind]
            log_rank(
                logger,
                30,
                f"optimizer group {g} ({_kind(group)}) loads the weights of checkpoint group {source} "
                f"({_kind(saved['options'])}) but not its optimizer state or options: they start fresh",
            )
            for param in group["params"]:
                if part.optimizer_params is None or id(param) in part.optimizer_params:
                    optimizer.state.pop(param, None)
            continue
        cpu_scalars = not (group.get("capturable") or group.get("fused"))
        for param in group["params"]:
            if part.optimizer_params is not None and id(param) not in part.optimizer_params:
                continue  # another part's
            old = optimizer.state.get(param, {})
            device = torch.device("cpu") if cpu_scalars else param.device
            new = {k: _scalar(r, old.get(k), device) for k, r in saved["scalars"].items()}
            new.update(elementwise.get(id(param), {}))
            if info.elementwise and id(param) not in elementwise and saved["scalars"]:
                # This rank owns only padding of the group: zeros keep its state consistent with the others.
                kept = _group_state_keys(reader, saved, info.elementwise)
                new.update({k: _state_zeros(optimizer, param, d) for k, d in kept.items()})
            optimizer.state[param] = new
        for key, value in saved["options"].items():
            current = group.get(key)
            group[key] = tuple(value) if isinstance(current, tuple) and isinstance(value, list) else value
    if type(optimizer).__name__ != info.cls:
        log_rank(logger, 30, f"optimizer is {type(optimizer).__name__}, the checkpoint's was {info.cls}")


def _kind(options: dict[str, Any]) -> str:
    """[Note: optimizer state of another kind]
    Muon's groups keep a momentum for matrices and Adam's moments for the rest (optim/muon.py); an AdamW run's
    groups keep Adam's moments for everything. A group saved by one kind and loaded into the other (a run that
    switches optimizers, or a parameter whose name moved it between halves) loads its master weights only: the
    other kind's state and options (Muon's lr, momentum) would make the optimizer fail or train with the wrong
    settings, so its state starts fresh and a warning says so."""
    return "Muon matrices" if options.get("use_muon") else "elementwise"


def _group_state_keys(reader: CheckpointReader, saved: dict[str, Any], keys: dict[str, str]) -> dict[str, str]:
    """The elementwise state keys (with their dtypes) the checkpoint holds for the members of group `saved`, asked of
    a member whose file is at hand; all of `keys` when none is."""
    for name in saved["params"]:
        if reader.has_state(OPTIM, name, MASTER) is not None:
            return {key: dtype for key, dtype in keys.items() if reader.has_state(OPTIM, name, key)}
    return keys


# -- batch ---------------------------------------------------------------------------------------------------
# -- the collective call -------------------------------------------------------------------------------
def _restore_training_state(
    engine: CheckpointableEngine, reader: CheckpointReader, blob: dict[str, Any], load_lr_scheduler_states: bool
) -> None:
    meta = reader.metadata
    rank = engine.topology.rank
    adapt_batch(engine, meta)
    counters = meta.counters
    engine.global_steps = int(counters["global_steps"])
    engine.global_samples = int(counters["global_samples"])
    engine.skipped_steps = int(counters["skipped_steps"])
    gas = int(engine.config.gradient_accumulation_steps)
    # the same windows; with caller-owned ones micro-steps count step() calls whatever the accumulation steps
    same_windows = gas == int(meta.batch["gradient_accumulation_steps"]) or not engine.accumulation.managed
    # Another accumulation count: micro-steps restart on the boundary after the last optimizer step.
    engine.micro_steps = int(counters["micro_steps"]) if same_windows else engine.global_steps * gas
    if load_lr_scheduler_states and engine.lr_scheduler is not None and blob["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(blob["lr_scheduler"])
    sampler: Any = getattr(engine.training_dataloader, "sampler", None)
    if blob["data_sampler"] is not None and hasattr(sampler, "load_state_dict"):
        sampler.load_state_dict(blob["data_sampler"])
    if rng_file(rank) in meta.files:
        restore_rng_state(json.loads(reader.read_small(rng_file(rank))))
    else:
        log_rank(
            logger, 30, f"the checkpoint has no RNG state for rank {rank} (saved on {meta.world_size} ranks)", None
        )


@dataclasses.dataclass
class _Plan:
    """What this rank's load will write, worked out without writing anything ([Note: a torn load])."""

    reader: CheckpointReader
    state: ShardedState | None
    catalog: ModuleCatalog
    mapping: dict[str, str]  # engine name -> checkpoint name, `check_module_keys`
    blob: dict[str, Any]  # engine_state.pt: client state, lr scheduler, loss scaler, sampler


def _plan(engine: CheckpointableEngine, reader: CheckpointReader, strict: bool) -> _Plan:
    """The checks a load can make before it writes: keys, shapes, the tensor-parallel slicing and the engine state
    file (its CRC), so that a checkpoint refused on any rank is refused before any rank has written."""
    from zeroshard.tp.reshard import tensor_parallel_reader

    state = engine_state(engine)
    catalog = catalog_module(
        engine.module,
        state.sharded_params() if state is not None else {},
        shapes=full_shapes(state),
        peers=peer_tensors(state),
    )
    caller_split = bool(getattr(state, "caller_split", False))  # [Note: tensor-parallel checkpoints]
    reader = tensor_parallel_reader(reader, catalog.infos, caller_split)  # [Note: tensor-parallel resharding]
    mapping = check_module_keys(reader.metadata, catalog, strict)
    blob = torch.load(io.BytesIO(reader.read_small(ENGINE_STATE_FILE)), map_location="cpu", weights_only=False)
    return _Plan(reader, state, catalog, mapping, blob)


def _load_into(
    engine: CheckpointableEngine,
    plan: _Plan,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[dict[str, Any], bool]:
    """Restore this rank's state; returns (client_state, whether parameters must be re-published)."""
    reader, state, blob = plan.reader, plan.state, plan.blob
    meta = reader.metadata
    load_module_weights(reader, plan.catalog, state, plan.mapping)
    optimizer_too = (
        not load_module_only and load_optimizer_states and state is not None and engine.optimizer is not None
    )
    if not load_module_only:
        _restore_training_state(engine, reader, blob, load_lr_scheduler_states)
    if optimizer_too and meta.optimizer is None:
        log_rank(logger, 30, "the checkpoint has no optimizer state; the optimizer starts fresh")
        optimizer_too = False
    master_loaded = optimizer_too and bool(engine.config.zero_optimization.load_from_fp32_weights)
    ckpt_group: dict[int, int] = {}
    for part in state.parts() if state is not None else []:  # one part in memory at a time
        with part.hold(True):
            fill_targets(reader, part.model_targets(), plan.mapping)
            if optimizer_too:
                assert engine.optimizer is not None
                load_optimizer_state(reader, engine.optimizer, part, plan.mapping, master_loaded, ckpt_group)
            if engine.strategy is not None and not master_loaded:
                part.refresh_master()
    if optimizer_too and engine.loss_scaler is not None and blob["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(blob["loss_scaler"])
    publish = False
    if state is not None and engine.strategy is not None:
        # Module weights stored in another dtype than this engine computes in: rebuild them from fp32.
        publish = master_loaded and meta.compute_dtype != compute_dtype_name(engine)
    client_state: dict[str, Any] = blob["client_state"]
    return client_state, publish


def _turns(engine: CheckpointableEngine) -> tuple[int | None, int]:
    """`zero_optimization.pipeline_loading_checkpoint` (DeepSpeed's serial load, stage 3): the ranks of a node read
    their files one after another in local-rank order, so a node holds one rank's transient load buffers at a time
    instead of all of them. Returns the rank this one waits for (None: the first on its node, or the option off)
    and how many loads its node runs one after another (1 with the option off): the deadlines of the waits that
    span them grow with it, so a healthy node of many ranks is not taken for a stuck one."""
    if not engine.config.zero_optimization.pipeline_loading_checkpoint:
        return None, 1
    rank = engine.topology.rank
    nodes = NodeLayout.from_env(engine.topology.world_size)
    return (rank - 1 if nodes.local_of(rank) > 0 else None), nodes.ranks_per_node


def load_checkpoint(
    engine: CheckpointableEngine,
    load_dir: str | os.PathLike[str],
    tag: Any = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict[str, Any] | None]:
    """See `CheckpointMixin.load_checkpoint`."""
    rank, world_size = engine.topology.rank, engine.topology.world_size
    root = os.path.abspath(os.fspath(load_dir))
    sync = RankSync("load_checkpoint", rank, world_size, prefix=engine.topology.store_prefix)
    resolved: dict[str, Any] = {"dir": None, "error": None}
    universal = bool(engine.config.checkpoint.load_universal)  # [Note: universal checkpoints]
    try:
        latest = LATEST_UNIVERSAL if universal else LATEST_FILE
        resolved["dir"] = resolve_tag_dir(root, None if tag is None else str(tag), latest)
        if node_local(engine) is not None:  # each node's folder: of one save ([Note: node-local checkpoints])
            resolved["save"] = saved_by(resolved["dir"])
    except Exception as e:  # noqa: BLE001 - reported to every rank below, not raised on this one alone
        resolved["error"] = str(e)
    hello = sync.all_gather(ENTRY_PHASE, resolved, entry_timeout())
    errors = sorted({h["error"] for h in hello if h["error"]})
    if errors:
        raise CheckpointError("; ".join(errors))
    dirs = [h["dir"] for h in hello]  # node-local: each node its own folder, the same tag ([Note: node-local ..])
    same = {os.path.basename(d) if d and node_local(engine) is not None else d for d in dirs}
    if len(same) > 1:
        raise CheckpointError(f"load_checkpoint: ranks resolved different checkpoints {dirs}")
    if len({h.get("save") for h in hello}) > 1:
        saves = sorted({f"{h['save']} ({h['dir']})" for h in hello})
        raise CheckpointError(
            f"load_checkpoint: the nodes' folders hold different saves of one tag: {saves} (a save whose commit "
            "failed on some nodes); load a tag every node committed"
        )
    tag_dir = resolved["dir"]
    if tag_dir is None:
        log_rank(logger, 30, f"no {LATEST_FILE} file in {root}: nothing loaded (pass tag= to load a given checkpoint)")
        return None, None
    local_error: Exception | None = None
    client_state: dict[str, Any] | None = None
    publish, plan, wrote = False, None, False
    after, in_line = _turns(engine)
    try:  # the checks that write nothing, on every rank at once ([Note: a torn load])
        opened = UniversalReader(tag_dir) if universal else CheckpointReader(tag_dir)
        try:
            if not universal:
                check_loadable(opened.metadata, tag_dir, engine)
            plan = _plan(engine, opened, load_module_strict)
        except BaseException:
            opened.close()
            raise
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        local_error = e
    checked = sync.all_gather("checked", {"error": None if local_error is None else str(local_error)}, write_timeout())
    if any(s["error"] for s in checked):
        if plan is not None:
            plan.reader.close()
        sync.leave(write_timeout())
        raise CheckpointError(
            f"load_checkpoint({tag_dir!r}) refused, nothing was loaded: {describe_errors(checked)}"
        ) from local_error
    assert plan is not None
    try:
        with sync.in_turn(after, write_timeout() * max(1, in_line - 1)), opened:
            with torch.profiler.record_function("zeroshard.load_checkpoint"):
                wrote = True
                client_state, publish = _load_into(
                    engine, plan, load_optimizer_states, load_lr_scheduler_states, load_module_only
                )
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        local_error = e
    status = {"error": None if local_error is None else str(local_error), "wrote": wrote}
    statuses = sync.all_gather("loaded", status, write_timeout() * in_line)
    sync.leave(write_timeout() * in_line)
    scope = load_scope(load_optimizer_states, load_module_only)
    if any(s["error"] for s in statuses):
        described = describe_errors(statuses)
        if any(s["wrote"] for s in statuses):
            mark_torn(engine, f"load_checkpoint({tag_dir!r}) failed part way ({described})", scope)
            raise CheckpointError(
                f"load_checkpoint failed part way: {described}; the engine holds part of the checkpoint and refuses to "
                "train or save until a load_checkpoint succeeds"
            ) from local_error
        raise CheckpointError("load_checkpoint failed, nothing was loaded: " + described) from local_error
    repaired(engine, scope)
    # Collectives only once every rank is known to have loaded (a failed rank would never join them).
    if engine.strategy is not None:
        state = engine_state(engine)
        # stage 3 loads shards only: copies gathered from them (its persistent unit) must be gathered again
        if state is not None and (publish or state.regather_after_load):
            state.publish_params()
        engine.strategy.loaded()
        engine.strategy.zero_grad()
        engine.accumulation.pending, engine.accumulation.window_backwards = False, 0
    log_rank(logger, 20, f"loaded checkpoint {tag_dir}")
    return tag_dir, client_state
