"""`save_checkpoint`: every rank writes its pieces in parallel; rank 0 commits the directory atomically.

The phases (see [Note: collective calls with a deadline] and [Note: crash safety]):
1. start: all ranks agree on the tag, directory and a nonce for the temporary directory;
2. write: each rank writes its model/optimizer pieces and RNG state (rank 0 also the engine state)
   into `<save_dir>/.tmp.<tag>.<nonce>/` and fsyncs them; its manifest (files, sizes, CRCs, pieces)
   goes to rank 0;
3. commit: rank 0 writes metadata.json, renames the directory to `<save_dir>/<tag>`, replaces `latest`
   and tells every rank the outcome. A failure on any rank is raised on every rank.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zeroshard.checkpoint.atomic import (
    commit_directory,
    fault_point,
    fsync_tree,
    replace_file_atomically,
    write_file,
)
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import (
    ENGINE_STATE_FILE,
    LATEST_FILE,
    MASTER,
    METADATA_FILE,
    CheckpointMetadata,
    OptimizerInfo,
    PieceRef,
    TensorInfo,
    model_file,
    optim_file,
    piece_key,
    rng_file,
)
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.checkpoint.rng import capture_rng_state
from zeroshard.checkpoint.safetensors_io import SafetensorsWriter, TensorSpec, dtype_name
from zeroshard.checkpoint.space import bytes_to_write, check_space, describe_write_error, rank_bytes, space_report
from zeroshard.checkpoint.state import ModelPiece, OptimPiece, ShardedState
from zeroshard.checkpoint.sync import ENTRY_PHASE, RankSync, describe_errors, entry_timeout, write_timeout
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


@dataclass
class ModuleCatalog:
    """The module's state_dict as the checkpoint sees it: canonical tensors, tied aliases, exclusions."""

    tensors: dict[str, torch.Tensor]
    infos: dict[str, TensorInfo]
    aliases: dict[str, str] = field(default_factory=dict)
    excluded: list[str] = field(default_factory=list)


def catalog_module(
    module: torch.nn.Module,
    sharded: dict[int, str],
    exclude_frozen: bool = False,
    shapes: dict[int, tuple[int, ...]] | None = None,
    peers: dict[str, TensorInfo] | None = None,
) -> ModuleCatalog:
    """Canonical name per distinct tensor (the strategy's name for sharded parameters, else the first key).
    `shapes` gives the full shape of parameters whose module tensor is a placeholder (stage 3); `peers` the
    tensors other ranks hold and this module does not (`ShardedState.peer_tensors`): in `infos`, not `tensors`."""
    shapes = shapes or {}
    catalog = ModuleCatalog({}, {})
    param_ids = {id(p) for p in module.parameters()}
    canonical_of: dict[int, str] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        ident = id(tensor)
        if ident in canonical_of:
            catalog.aliases[key] = canonical_of[ident]
            continue
        name = sharded.get(ident, key)
        canonical_of[ident] = name
        if name != key:
            catalog.aliases[key] = name
        is_param = ident in param_ids
        requires_grad = bool(is_param and tensor.requires_grad)
        if exclude_frozen and is_param and not requires_grad and ident not in sharded:
            catalog.excluded.append(name)
            continue
        catalog.tensors[name] = tensor
        catalog.infos[name] = TensorInfo(
            shapes.get(ident, tuple(tensor.shape)),
            dtype_name(tensor.dtype),
            "param" if is_param else "buffer",
            ident in sharded,
            requires_grad,
        )
    catalog.aliases = {a: c for a, c in catalog.aliases.items() if c not in catalog.excluded}
    for name, info in (peers or {}).items():
        catalog.infos.setdefault(name, info)
    return catalog


def full_shapes(state: ShardedState | None) -> dict[int, tuple[int, ...]]:
    """Full shapes of sharded parameters, for strategies whose module tensors are placeholders."""
    return state.full_shapes() if state is not None else {}


def peer_tensors(state: ShardedState | None) -> dict[str, TensorInfo]:
    return state.peer_tensors() if state is not None else {}


def engine_state(engine: CheckpointableEngine) -> ShardedState | None:
    """The strategy's `ShardedState` (see [Note: strategy adapters]); None without an optimizer."""
    return engine.strategy.checkpoint_state() if engine.strategy is not None else None


# -- optimizer state ------------------------------------------------------------------------------------
def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _scalar_record(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        return {"value": value.item(), "tensor": dtype_name(value.dtype)}
    return {"value": value, "tensor": None}


def split_optimizer_state(
    optimizer: torch.optim.Optimizer, param: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(elementwise tensors, scalar records) of one optimizer parameter's state."""
    elementwise: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for key, value in optimizer.state.get(param, {}).items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == param.numel():
            elementwise[key] = value
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            scalars[key] = _scalar_record(value)
        elif not isinstance(value, torch.Tensor) and _jsonable(value):
            scalars[key] = _scalar_record(value)
        else:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise CheckpointError(
                f"optimizer state {key!r} ({shape}) of {type(optimizer).__name__} is neither elementwise nor a "
                "scalar; zeroshard checkpoints shard elementwise optimizer state only"
            )
    return elementwise, scalars


def optimizer_info(optimizer: torch.optim.Optimizer) -> OptimizerInfo:
    """Class, group options and scalar state; elementwise keys and group members come from the manifests."""
    groups = []
    for group in optimizer.param_groups:
        options = {k: v for k, v in group.items() if k != "params" and _jsonable(v)}
        scalars: dict[str, Any] = {}
        for param in group["params"]:
            scalars.update(split_optimizer_state(optimizer, param)[1])
        groups.append({"options": options, "params": [], "scalars": scalars})
    return OptimizerInfo(type(optimizer).__name__, {}, groups)


# -- writing one rank's files ---------------------------------------------------------------------------
@dataclass
class RankManifest:
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    model_pieces: dict[str, list[list[Any]]] = field(default_factory=dict)
    optim_pieces: dict[str, list[list[Any]]] = field(default_factory=dict)
    elementwise: dict[str, str] = field(default_factory=dict)
    param_groups: dict[str, int] = field(default_factory=dict)  # parameter name -> optimizer group


def _write_safetensors(tmp_dir: str, rel: str, entries: list[tuple[str, torch.Tensor]], rank: int) -> dict[str, Any]:
    specs = [TensorSpec(key, t.dtype, (t.numel(),)) for key, t in entries]
    writer = SafetensorsWriter(os.path.join(tmp_dir, rel), specs)
    try:
        for i, (_, tensor) in enumerate(entries):
            writer.add(tensor)
            if i == len(entries) // 2:
                fault_point("mid_file", rank)
        size = writer.close()
    except BaseException:
        writer.abort()
        raise
    return {"bytes": size, "header_crc32": writer.header_crc32()}


def write_model_file(tmp_dir: str, rank: int, pieces: list[ModelPiece], manifest: RankManifest, part: str = "") -> None:
    if not pieces:
        return
    rel = model_file(rank, part)
    entries = [(piece_key(p.name, p.begin, p.end), p.values) for p in pieces]
    manifest.files[rel] = _write_safetensors(tmp_dir, rel, entries, rank)
    for p in pieces:
        manifest.model_pieces.setdefault(p.name, []).append([rel, p.begin, p.end])


def write_optim_file(
    tmp_dir: str,
    rank: int,
    optimizer: torch.optim.Optimizer,
    pieces: list[OptimPiece],
    manifest: RankManifest,
    part: str = "",
) -> None:
    if not pieces:
        return
    rel = optim_file(rank, part)
    entries: list[tuple[str, torch.Tensor]] = []
    for p in pieces:
        elementwise = split_optimizer_state(optimizer, p.param)[0]
        entries.append((piece_key(p.name, p.begin, p.end, MASTER), p.view(p.param)))
        for key in sorted(elementwise):
            manifest.elementwise[key] = dtype_name(elementwise[key].dtype)
            entries.append((piece_key(p.name, p.begin, p.end, key), p.view(elementwise[key])))
        manifest.optim_pieces.setdefault(p.name, []).append([rel, p.begin, p.end])
        manifest.param_groups[p.name] = p.group
    manifest.files[rel] = _write_safetensors(tmp_dir, rel, entries, rank)


def _engine_state_bytes(engine: CheckpointableEngine, client_state: dict[str, Any]) -> bytes:
    sampler: Any = getattr(engine.training_dataloader, "sampler", None)
    state = {
        "client_state": client_state,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "data_sampler": sampler.state_dict() if hasattr(sampler, "state_dict") else None,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def write_rank_files(
    engine: CheckpointableEngine,
    tmp_dir: str,
    catalog: ModuleCatalog,
    state: ShardedState | None,
    client_state: dict[str, Any],
) -> RankManifest:
    rank = engine.topology.rank
    manifest = RankManifest()
    replicated = []
    if rank == 0:  # tensors no strategy shards are replicated: rank 0 writes them whole
        for name, tensor in catalog.tensors.items():
            if not catalog.infos[name].trainable:
                replicated.append(ModelPiece(name, 0, tensor.numel(), tensor.detach().reshape(-1)))
    parts = state.parts() if state is not None else []
    if not parts:
        write_model_file(tmp_dir, rank, replicated, manifest)
    for i, part in enumerate(parts):  # one part in memory at a time ([Note: state parts])
        with part.hold(False):
            pieces = part.model_pieces() + (replicated if i == 0 else [])
            write_model_file(tmp_dir, rank, pieces, manifest, part.suffix)
            if engine.optimizer is not None and state is not None and state.writes_optim:
                owned = (part.optim_pieces_to_save or part.optim_pieces)()
                write_optim_file(tmp_dir, rank, engine.optimizer, owned, manifest, part.suffix)
    manifest.files[rng_file(rank)] = write_file(
        os.path.join(tmp_dir, rng_file(rank)), json.dumps(capture_rng_state()).encode()
    )
    if rank == 0:
        manifest.files[ENGINE_STATE_FILE] = write_file(
            os.path.join(tmp_dir, ENGINE_STATE_FILE), _engine_state_bytes(engine, client_state)
        )
    return manifest


# -- metadata and commit (rank 0) -----------------------------------------------------------------------
def compute_dtype_name(engine: CheckpointableEngine) -> str:
    return dtype_name(engine.precision.compute_dtype)


def _merge_pieces(manifests: list[dict[str, Any]], key: str) -> dict[str, list[PieceRef]]:
    merged: dict[str, list[PieceRef]] = {}
    for m in manifests:
        for name, refs in m[key].items():
            merged.setdefault(name, []).extend(PieceRef(f, b, e) for f, b, e in refs)
    return merged


def _check_tiled(pieces: dict[str, list[PieceRef]], infos: dict[str, TensorInfo], what: str) -> None:
    """Every listed tensor is covered exactly once: a save that loses elements must fail, not load."""
    for name, refs in pieces.items():
        position = 0
        for ref in sorted(refs, key=lambda r: r.begin):
            if ref.begin != position:
                raise CheckpointError(f"internal error: {what} pieces of {name!r} leave a gap or overlap at {position}")
            position = ref.end
        if position != infos[name].numel:
            raise CheckpointError(f"internal error: {what} pieces of {name!r} cover {position} of {infos[name].numel}")


def build_metadata(
    engine: CheckpointableEngine,
    tag: str,
    catalog: ModuleCatalog,
    optim_info: OptimizerInfo | None,
    manifests: list[dict[str, Any]],
) -> CheckpointMetadata:
    import zeroshard

    files: dict[str, dict[str, Any]] = {}
    for m in manifests:
        files.update(m["files"])
    model_pieces = _merge_pieces(manifests, "model_pieces")
    optim_pieces = _merge_pieces(manifests, "optim_pieces")
    _check_tiled(model_pieces, catalog.infos, "model")
    _check_tiled(optim_pieces, catalog.infos, "optimizer")
    if optim_info is not None:
        for m in manifests:
            optim_info.elementwise.update(m["elementwise"])
            for name, g in m["param_groups"].items():
                if name not in optim_info.groups[g]["params"]:
                    optim_info.groups[g]["params"].append(name)
    cfg = engine.config
    return CheckpointMetadata(
        tag=tag,
        world_size=engine.topology.world_size,
        zero_stage=int(cfg.zero_optimization.stage),
        compute_dtype=compute_dtype_name(engine),
        library_version=zeroshard.__version__,
        torch_version=torch.__version__,
        batch={
            "train_batch_size": int(cfg.train_batch_size),
            "train_micro_batch_size_per_gpu": int(cfg.train_micro_batch_size_per_gpu),
            "gradient_accumulation_steps": int(cfg.gradient_accumulation_steps),
        },
        counters={
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps,
        },
        tensors=catalog.infos,
        aliases=catalog.aliases,
        excluded=catalog.excluded,
        model_pieces=model_pieces,
        optim_pieces=optim_pieces,
        optimizer=optim_info,
        files=files,
    )


def _commit(save_dir: str, tmp_dir: str, tag: str, nonce: str, meta: CheckpointMetadata, save_latest: bool) -> str:
    write_file(os.path.join(tmp_dir, METADATA_FILE), meta.to_json().encode())
    fsync_tree(tmp_dir)
    fault_point("before_rename", 0)
    final = os.path.join(save_dir, tag)
    commit_directory(tmp_dir, final, nonce, 0)
    fault_point("before_latest", 0)
    if save_latest:
        replace_file_atomically(os.path.join(save_dir, LATEST_FILE), tag.encode())
    return final


# -- the collective call -------------------------------------------------------------------------------
def _validate_tag(tag: str) -> str:
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain directory name (no '/', not hidden)")
    return tag


def _agree_on_tag(hello: list[dict[str, Any]], validation: str) -> None:
    tags = [h["tag"] for h in hello]
    if len(set(tags)) > 1:
        message = f"save_checkpoint: ranks passed different tags {tags}; rank 0's tag {tags[0]!r} is used"
        if validation == "FAIL":
            raise CheckpointError(message + " (checkpoint.tag_validation is FAIL)")
        if validation == "WARN":
            log_rank(logger, 30, message)
    dirs = {h["dir"] for h in hello}
    if len(dirs) > 1:
        raise CheckpointError(f"save_checkpoint: ranks passed different save_dir values {sorted(dirs)}")


def save_checkpoint(
    engine: CheckpointableEngine,
    save_dir: str | os.PathLike[str],
    tag: Any = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """See `CheckpointMixin.save_checkpoint`."""
    if not save_dir:
        raise CheckpointError(f"save_checkpoint: save_dir must be a non-empty path, got {save_dir!r}")
    rank, world_size = engine.topology.rank, engine.topology.world_size
    root = os.path.abspath(os.fspath(save_dir))
    tag = _validate_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}")
    state = engine_state(engine)
    sync = RankSync("save_checkpoint", rank, world_size)
    hello = sync.all_gather(
        ENTRY_PHASE,
        {"tag": tag, "dir": root, "nonce": uuid.uuid4().hex[:12], **space_report(root, bytes_to_write(engine, state))},
        entry_timeout(),
    )
    _agree_on_tag(hello, str(engine.config.checkpoint.tag_validation).upper())
    check_space(hello, root)
    tag, nonce = hello[0]["tag"], hello[0]["nonce"]
    tmp_dir = os.path.join(root, f".tmp.{tag}.{nonce}")
    if engine.accumulation.pending:
        log_rank(logger, 30, "save_checkpoint inside an accumulation window: the partial gradients are not saved")

    catalog = catalog_module(
        engine.module,
        state.sharded_params() if state else {},
        exclude_frozen_parameters,
        full_shapes(state),
        peer_tensors(state),
    )
    payload: dict[str, Any] = {"error": None, "manifest": None}
    optim_info = None
    try:
        for sub in ("model", "optim", "rng"):
            os.makedirs(os.path.join(tmp_dir, sub), exist_ok=True)
        with torch.profiler.record_function("zeroshard.save_checkpoint"):
            manifest = write_rank_files(engine, tmp_dir, catalog, state, dict(client_state or {}))
        if rank == 0 and state is not None and engine.optimizer is not None:
            optim_info = optimizer_info(engine.optimizer)
        payload["manifest"] = asdict(manifest)
        fault_point("after_rank_files", rank)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        payload["error"] = describe_write_error(e, tmp_dir, rank_bytes(state, engine.optimizer))
        local_error: Exception | None = e
    else:
        local_error = None
    manifests = sync.gather("written", payload, write_timeout())
    outcome: dict[str, Any] = {"error": None}
    if manifests is not None:  # rank 0
        try:
            if any(m["error"] for m in manifests):
                raise CheckpointError(describe_errors(manifests))
            meta = build_metadata(engine, tag, catalog, optim_info, [m["manifest"] for m in manifests])
            if getattr(state, "caller_split", False):  # [Note: tensor-parallel checkpoints] in tp/checkpoint.py
                meta.extra["tensor_parallel_caller_split"] = True
            final = _commit(root, tmp_dir, tag, nonce, meta, save_latest)
            log_rank(logger, 20, f"saved checkpoint {final} ({world_size} ranks, stage {meta.zero_stage})")
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            outcome["error"] = f"save_checkpoint failed, nothing was committed: {e}"
            local_error = local_error or e
            # every rank is past its writes (they reported): the partial save must not keep the disk full
            shutil.rmtree(tmp_dir, ignore_errors=True)
    outcome = sync.broadcast("committed", outcome, write_timeout())
    sync.leave(write_timeout())
    if outcome["error"]:
        raise CheckpointError(outcome["error"]) from local_error
    return True
