"""`save_checkpoint`: every rank writes its pieces in parallel; rank 0 commits the directory atomically.

The phases (see [Note: collective calls with a deadline] and [Note: crash safety]):
1. start: all ranks agree on the tag, directory and a nonce for the temporary directory;
2. write: each rank writes its model/optimizer pieces and RNG state (rank 0 also the engine state)
   into `<save_dir>/.tmp.<tag>.<nonce>/` and fsyncs them; its manifest (files, sizes, CRCs, pieces)
   goes to rank 0;
3. commit: rank 0 writes metadata.json, renames the directory to `<save_dir>/<tag>`, replaces `latest`
   and tells every rank the outcome. A failure on any rank is raised on every rank.
A decoupled save (`checkpoint.writer.decoupled`) returns after phase 1, writes on a thread, and commits later:
[Note: decoupled checkpoint writes] in decoupled.py.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zeroshard.checkpoint.atomic import fault_point
from zeroshard.checkpoint.commit import CommittedWithoutLatest, commit_tag, validate_tag
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import CheckpointMetadata, PieceRef, TensorInfo
from zeroshard.checkpoint.node_local import NodeLocal, node_local, per_node_metadata, settle
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.checkpoint.rank_files import RankFiles, add_rank_files, optimizer_info, take_snapshot
from zeroshard.checkpoint.safetensors_io import dtype_name
from zeroshard.checkpoint.space import bytes_to_write, check_space, describe_write_error, rank_bytes, space_report
from zeroshard.checkpoint.state import ModelPiece, ShardedState
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
    excludable: frozenset[int] = frozenset(),
) -> ModuleCatalog:
    """Canonical name per distinct tensor (the strategy's name for sharded parameters, else the first key).
    `shapes` gives the full shape of parameters whose module tensor is a placeholder (stage 3); `peers` the
    tensors other ranks hold and this module does not (`ShardedState.peer_tensors`): in `infos`, not `tensors`;
    `excludable`: sharded frozen parameters `exclude_frozen` leaves out too (an expert-parallel model's frozen
    experts: [Note: expert checkpoints])."""
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
        if exclude_frozen and is_param and not requires_grad and (ident not in sharded or ident in excludable):
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
        if exclude_frozen and not info.requires_grad:  # its own rank leaves it out: so does the catalog
            if name not in catalog.excluded:
                catalog.excluded.append(name)
            continue
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


def start_metadata(engine: CheckpointableEngine, tag: str, catalog: ModuleCatalog) -> CheckpointMetadata:
    """metadata.json as of the call (the engine's counters then), without the files and pieces of the ranks."""
    import zeroshard

    cfg = engine.config
    optimizer = engine.basic_optimizer if engine.strategy is not None else None
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
        model_pieces={},
        optim_pieces={},
        optimizer=optimizer_info(optimizer) if optimizer is not None else None,
        files={},
    )


def complete_metadata(meta: CheckpointMetadata, manifests: list[dict[str, Any]]) -> CheckpointMetadata:
    """`meta` with every rank's files and pieces; refuses a save that does not cover every element once."""
    for m in manifests:
        meta.files.update(m["files"])
    meta.model_pieces = _merge_pieces(manifests, "model_pieces")
    meta.optim_pieces = _merge_pieces(manifests, "optim_pieces")
    _check_tiled(meta.model_pieces, meta.tensors, "model")
    _check_tiled(meta.optim_pieces, meta.tensors, "optimizer")
    if meta.optimizer is not None:
        for m in manifests:
            meta.optimizer.elementwise.update(m["elementwise"])
            for name, g in m["param_groups"].items():
                if name not in meta.optimizer.groups[g]["params"]:
                    meta.optimizer.groups[g]["params"].append(name)
    return meta


# -- the collective call -------------------------------------------------------------------------------
def _agree_on_tag(hello: list[dict[str, Any]], validation: str, placement: NodeLocal | None) -> None:
    tags = [h["tag"] for h in hello]
    if len(set(tags)) > 1:
        different = f"save_checkpoint: ranks passed different tags {tags}"
        if validation == "FAIL":
            raise CheckpointError(
                f"{different}; nothing was saved (checkpoint.tag_validation is FAIL): pass every rank the same tag"
            )
        if validation == "WARN":
            log_rank(logger, 30, f"{different}; rank 0's tag {tags[0]!r} is used")
    nodes = [placement.layout.node_of(r) if placement is not None else 0 for r in range(len(hello))]
    for node in sorted(set(nodes)):  # [Note: node-local checkpoints]: each node may name its own disk's folder
        dirs = {h["dir"] for h, n in zip(hello, nodes, strict=True) if n == node}
        if len(dirs) > 1:
            raise CheckpointError(f"save_checkpoint: ranks passed different save_dir values {sorted(dirs)}")


_CALLS = itertools.count()
_LATEST_BY: dict[str, int] = {}  # save directory -> the order of the call whose commit last wrote its `latest`


@dataclass
class SaveCall:
    """One `save_checkpoint` call on this rank, from the ranks' agreement to the commit."""

    sync: RankSync
    root: str
    tag: str
    nonce: str
    tmp_dir: str
    save_latest: bool
    files: RankFiles
    meta: CheckpointMetadata | None  # rank 0
    need: int  # bytes this rank writes, for the out-of-space message
    show_statistics: bool
    placement: NodeLocal | None = None  # [Note: node-local checkpoints]
    payload: dict[str, Any] = field(default_factory=lambda: {"error": None, "manifest": None})
    local_error: Exception | None = None
    order: int = field(default_factory=lambda: next(_CALLS))  # among this process's save calls

    @property
    def commits(self) -> bool:
        """Whether this rank commits (or removes) the folder: rank 0, or node-local each node's leader."""
        return self.placement.leader if self.placement is not None else self.sync.rank == 0

    def fail(self, error: Exception) -> None:
        self.payload["error"] = describe_write_error(error, self.tmp_dir, self.need)
        self.local_error = error

    def write(self) -> None:
        """Phase 2 for the files listed but not yet written (a decoupled save's, on its thread)."""
        try:
            self.files.write_all()
            self.written()
        except Exception as e:  # noqa: BLE001 - reported to every rank by finish_save
            self.fail(e)

    def written(self) -> None:
        self.payload["manifest"] = asdict(self.files.manifest)
        fault_point("after_rank_files", self.files.rank)
        if self.show_statistics:  # checkpoint.writer.show_statistics: every writing rank, as DeepSpeed's writer
            files, seconds = self.files, max(self.files.seconds, 1e-9)
            logger.info(
                f"checkpoint writer: rank {files.rank} wrote {files.bytes_written / 2**20:.1f} MiB in {seconds:.2f} s "
                f"({files.bytes_written / 2**20 / seconds:.1f} MiB/s) for {self.tag}"
            )


def _replicated(catalog: ModuleCatalog, shared_writer: bool, deferred: bool) -> list[ModelPiece]:
    """The tensors no strategy shards, which rank 0 (node-local: each node's leader) writes whole. A decoupled save
    copies the buffers now (a forward may update them in place: norm statistics); frozen parameters are written from
    the module as they are."""
    pieces = []
    for name, tensor in catalog.tensors.items() if shared_writer else ():
        info = catalog.infos[name]
        if not info.trainable:
            values = tensor.detach().reshape(-1)
            pieces.append(
                ModelPiece(name, 0, values.numel(), values.clone() if deferred and info.kind == "buffer" else values)
            )
    return pieces


def start_save(
    engine: CheckpointableEngine,
    save_dir: str | os.PathLike[str],
    tag: Any,
    client_state: dict[str, Any],
    save_latest: bool,
    exclude_frozen_parameters: bool,
    deferred: bool,
) -> SaveCall:
    """Phase 1, then this rank's files listed with what the call must read now; written unless `deferred`."""
    if not save_dir:
        raise CheckpointError(f"save_checkpoint: save_dir must be a non-empty path, got {save_dir!r}")
    rank, world_size = engine.topology.rank, engine.topology.world_size
    root = os.path.abspath(os.fspath(save_dir))
    tag = validate_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}", root)
    state = engine_state(engine)
    placement = node_local(engine)
    if placement is not None and state is not None and state.peer_tensors():
        raise CheckpointError(
            "checkpoint.use_node_local_storage with MoE expert parallelism (ep_size > 1) is not supported: save to a "
            "folder every node sees"
        )
    sync = RankSync("save_checkpoint", rank, world_size, prefix=engine.topology.store_prefix)
    hello = sync.all_gather(
        ENTRY_PHASE,
        {
            "tag": tag,
            "dir": root,
            "nonce": uuid.uuid4().hex[:12],
            "per_node": placement.layout.ranks_per_node if placement is not None else None,
            **space_report(root, bytes_to_write(engine, state, exclude_frozen_parameters)),
        },
        entry_timeout(),
    )
    _agree_on_tag(hello, str(engine.config.checkpoint.tag_validation).upper(), placement)
    check_space(hello, root)
    tag, nonce = hello[0]["tag"], hello[0]["nonce"]
    if placement is not None:  # [Note: node-local checkpoints]
        placement = settle(placement, sync, hello, root, nonce)
    tmp_dir = os.path.join(root, f".tmp.{tag}.{nonce}")
    if engine.accumulation.pending:
        log_rank(
            logger,
            30,
            "save_checkpoint inside an accumulation window: the partial gradients are not saved (a load starts the "
            "window again)",
        )
    writer = engine.config.checkpoint.writer
    call = SaveCall(
        sync,
        root,
        tag,
        nonce,
        tmp_dir,
        save_latest,
        RankFiles(tmp_dir, rank, deferred),
        None,
        rank_bytes(state, engine.basic_optimizer, exclude_frozen=exclude_frozen_parameters),
        bool(writer is not None and writer.show_statistics),
        placement,
    )
    try:
        catalog = catalog_module(
            engine.module,
            state.sharded_params() if state else {},
            exclude_frozen_parameters,
            full_shapes(state),
            peer_tensors(state),
            getattr(state, "frozen_ids", frozenset()),
        )
        if rank == 0:
            call.meta = start_metadata(engine, tag, catalog)
            if getattr(state, "caller_split", False):  # [Note: tensor-parallel checkpoints] in tp/checkpoint.py
                call.meta.extra["tensor_parallel_caller_split"] = True
            if getattr(state, "tp_blocks", None):  # (the same note)
                call.meta.extra["tensor_parallel_blocks"] = dict(state.tp_blocks)  # type: ignore[union-attr]
            if getattr(state, "tp_dims", None):  # the offline export joins slices along them
                call.meta.extra["tensor_parallel_dims"] = dict(state.tp_dims)  # type: ignore[union-attr]
        for sub in ("model", "optim", "rng"):
            os.makedirs(os.path.join(tmp_dir, sub), exist_ok=True)
        shared_writer = call.commits
        replicated = _replicated(catalog, shared_writer, deferred)
        with torch.profiler.record_function("zeroshard.save_checkpoint"):
            snapshot = take_snapshot(engine, client_state, shared_writer)
            add_rank_files(engine, call.files, replicated, state, snapshot, placement, frozenset(catalog.excluded))
        if not deferred:
            call.written()
    except Exception as e:  # noqa: BLE001 - reported to every rank by finish_save
        call.files.jobs.clear()
        call.fail(e)
    return call


def _names_latest(call: SaveCall) -> bool:
    """Whether this commit writes `latest`: not when a save call made after it in this process has written it
    already (a decoupled save of an engine dropped without destroy(), committed at exit after another engine's
    later save into the same directory, must not move `latest` back)."""
    if call.save_latest and _LATEST_BY.get(call.root, -1) > call.order:
        log_rank(logger, 20, f"checkpoint {call.tag}: `latest` in {call.root} keeps naming a later save's tag")
        return False
    return call.save_latest


def finish_save(call: SaveCall) -> bool:
    """Phase 3: rank 0 commits what every rank wrote, or nothing; the outcome is raised on every rank."""
    sync, world_size = call.sync, call.sync.world_size
    manifests = sync.gather("written", call.payload, write_timeout())
    outcome: dict[str, Any] = {"error": None}
    local_error = call.local_error
    nodes: list[str] = []
    if manifests is not None:  # rank 0
        try:
            if any(m["error"] for m in manifests):
                raise CheckpointError(describe_errors(manifests))
            assert call.meta is not None
            manifests_only = [m["manifest"] for m in manifests]
            if call.placement is not None:  # each node's leader commits its own: [Note: node-local checkpoints]
                nodes = per_node_metadata(call.meta, manifests_only, call.placement.layout, call.nonce)
            else:
                meta = complete_metadata(call.meta, manifests_only)
                _commit_here(call, meta.to_json())
                where = os.path.join(call.root, call.tag)
                log_rank(logger, 20, f"saved checkpoint {where} ({world_size} ranks, stage {meta.zero_stage})")
        except CommittedWithoutLatest as e:
            outcome["error"] = f"save_checkpoint: {e}"
            local_error = local_error or e
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            outcome["error"] = f"save_checkpoint failed, nothing was committed: {e}"
            local_error = local_error or e
            if call.placement is None:  # every rank is past its writes: the partial save must not keep the disk full
                shutil.rmtree(call.tmp_dir, ignore_errors=True)
    outcome = sync.broadcast("committed", outcome, write_timeout())
    if call.placement is not None:
        layout = call.placement.layout  # each leader gets its node's metadata, the others nothing
        per_rank = [nodes[layout.node_of(r)] if nodes and layout.local_of(r) == 0 else None for r in range(world_size)]
        node_meta = sync.scatter("node_metadata", per_rank if manifests is not None else None, write_timeout())
        local_error = _finish_nodes(call, outcome, node_meta) or local_error
    sync.leave(write_timeout())
    if outcome["error"]:
        raise CheckpointError(outcome["error"]) from local_error
    return True


def _commit_here(call: SaveCall, meta: str) -> None:
    """metadata.json, the rename and `latest` in this rank's folder (rank 0's; node-local: each leader's)."""
    latest = _names_latest(call)
    commit_tag(call.root, call.tmp_dir, call.tag, call.nonce, meta, latest)
    if latest:  # recorded once written: a failed commit leaves `latest` as it was
        _LATEST_BY[call.root] = call.order


def _finish_nodes(call: SaveCall, outcome: dict[str, Any], node_meta: str | None) -> Exception | None:
    """Each node's leader commits its node's folder, or removes it when any rank or node failed; every rank learns
    whether all committed (`outcome["error"]`) once the failed folders are gone."""
    placement, error = call.placement, None
    assert placement is not None
    report: dict[str, Any] = {"error": None}
    if placement.leader and not outcome["error"]:
        try:
            assert node_meta is not None
            _commit_here(call, node_meta)
            log_rank(logger, 20, f"saved checkpoint {call.root}/{call.tag} on node {placement.node}", ranks=None)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            report["error"], error = f"node {placement.node}: {e}", e
            report["committed"] = isinstance(e, CommittedWithoutLatest)  # its folder is in place, `latest` is not
    if placement.leader and (outcome["error"] or report["error"]):
        shutil.rmtree(call.tmp_dir, ignore_errors=True)
    reports = call.sync.all_gather("node_committed", report, write_timeout())
    failed = [r["error"] for r in reports if r["error"]]
    if failed and not outcome["error"]:
        others = (
            "the other nodes committed it: a load names the nodes' different saves"
            if len(failed) < placement.layout.nodes
            else "every node's folder is in place: load it by its tag"
            if any(r.get("committed") for r in reports)
            else "nothing was committed"
        )
        outcome["error"] = (
            f"save_checkpoint failed on {len(failed)} of {placement.layout.nodes} nodes ({'; '.join(failed)}); {others}"
        )
    return error


def save_checkpoint(
    engine: CheckpointableEngine,
    save_dir: str | os.PathLike[str],
    tag: Any = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """See `CheckpointMixin.save_checkpoint`: the whole call, written and committed before it returns."""
    call = start_save(engine, save_dir, tag, dict(client_state or {}), save_latest, exclude_frozen_parameters, False)
    return finish_save(call)
