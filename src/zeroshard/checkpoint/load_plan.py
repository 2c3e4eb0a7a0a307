"""The two halves of a rank's `load_checkpoint` ([Note: a torn load] in torn.py): `plan_load` makes the checks that
write nothing (keys, shapes, the tensor-parallel slicing, the engine state file), `load_into` writes the checkpoint's
values into the engine and says how much of its state it restored."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from zeroshard.checkpoint.batch import adapt_batch
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import ENGINE_STATE_FILE, CheckpointMetadata, rng_file
from zeroshard.checkpoint.load_optim import load_optimizer_state
from zeroshard.checkpoint.node_local import check_loadable, node_local
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.checkpoint.reshard import MODEL, CheckpointReader
from zeroshard.checkpoint.rng import restore_rng_state
from zeroshard.checkpoint.safetensors_io import SafetensorsReader
from zeroshard.checkpoint.save import (
    ModuleCatalog,
    catalog_module,
    compute_dtype_name,
    engine_state,
    full_shapes,
    peer_tensors,
)
from zeroshard.checkpoint.state import ModelPiece, ShardedState
from zeroshard.checkpoint.torn import MODULE, OPTIMIZER, TRAINING
from zeroshard.checkpoint.universal import UniversalReader
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


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


def check_module_keys(
    meta: CheckpointMetadata, catalog: ModuleCatalog, strict: bool, quiet: bool = False
) -> tuple[dict[str, str], list[str]]:
    """(engine canonical name -> checkpoint name, the engine's names the checkpoint lacks); missing/unexpected keys
    are errors when `strict`, else a warning unless `quiet` (a custom load function places the weights)."""
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
        if not quiet:
            log_rank(logger, 30, message)
    return mapping, missing


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


# -- training state ------------------------------------------------------------------------------------
def _restore_training_state(
    engine: CheckpointableEngine, reader: CheckpointReader, blob: dict[str, Any], load_lr_scheduler_states: bool
) -> bool:
    """Counters, the lr scheduler, the sampler and this rank's RNG; whether the lr scheduler (if any) was restored."""
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
    # Another accumulation count: micro-steps restart on the boundary after the last optimizer step. A save inside a
    # managed window kept none of its gradients (save.py warns): the window starts again, as DeepSpeed's (its load
    # leaves the micro-step count at 0), instead of ending after fewer micro-batches than it sums
    micro = int(counters["micro_steps"])
    if same_windows and engine.accumulation.managed:
        micro -= micro % gas
    engine.micro_steps = micro if same_windows else engine.global_steps * gas
    scheduler = load_lr_scheduler_states and engine.lr_scheduler is not None and blob["lr_scheduler"] is not None
    if scheduler:
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
    return scheduler or engine.lr_scheduler is None


# -- the files, before anything is written -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Reads:
    """Which files a load opens besides the module weights': the optimizer's, and this rank's RNG state."""

    optimizer: bool
    training: bool  # counters, scheduler, RNG (not `load_module_only`)


def check_files(meta: CheckpointMetadata, tag_dir: str, rank: int, reads: Reads, node_local_load: bool) -> None:
    """[Note: a torn load]: the files are opened as their tensors are read, after the first tensors were written, so a
    missing, truncated or replaced one would stop a load part way. Before anything is written: every file the load may
    read exists at the size the metadata records (with node-local storage another node's files are not here), and
    this rank's own files, which a load at the saving layout reads, have the header the metadata records."""
    files = {ref.file for refs in meta.model_pieces.values() for ref in refs}
    if reads.optimizer and meta.optimizer is not None:
        files |= {ref.file for refs in meta.optim_pieces.values() for ref in refs}
    if reads.training and rng_file(rank) in meta.files:
        files.add(rng_file(rank))
    own = f"rank{rank:05d}"
    for rel in sorted(files):
        path, record = os.path.join(tag_dir, rel), meta.files.get(rel)
        if record is None:
            raise CheckpointError(f"{path}: not listed in the checkpoint metadata; the checkpoint is incomplete")
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            if node_local_load:
                continue
            raise CheckpointError(f"{path}: checkpoint file is missing; load another checkpoint") from None
        if size != record["bytes"]:
            raise CheckpointError(
                f"{path}: file is {size} bytes but the checkpoint metadata says {record['bytes']}; it is truncated or "
                "was modified after the save"
            )
        if os.path.basename(rel).startswith(own) and rel.endswith(".safetensors"):
            SafetensorsReader(path, record["bytes"], record.get("header_crc32")).close()


# -- the two halves --------------------------------------------------------------------------------------
@dataclasses.dataclass
class LoadPlan:
    """What this rank's load will write, worked out without writing anything."""

    tag_dir: str
    universal: bool
    caller_split: bool  # [Note: tensor-parallel checkpoints]
    state: ShardedState | None
    catalog: ModuleCatalog
    mapping: dict[str, str]  # engine name -> checkpoint name, `check_module_keys`
    missing: list[str]  # engine names the checkpoint lacks (load_module_strict=False)
    blob: dict[str, Any]  # engine_state.pt: client state, lr scheduler, loss scaler, sampler
    opened: CheckpointReader | None = None  # the files' reader (None between the halves under turns)
    reader: CheckpointReader | None = None  # `opened`, resliced where the tensor-parallel size differs
    touched: bool = False  # counters or scalars were written (tensors: the readers' `delivered`)
    module_by_name: bool = True  # False: a custom load function wrote the module weights ([Note: custom_load_fn])
    _delivered: bool = False  # a closed reader's `delivered`

    def open(self) -> CheckpointReader:
        from zeroshard.tp.reshard import tensor_parallel_reader

        if self.opened is None:
            self.opened = UniversalReader(self.tag_dir) if self.universal else CheckpointReader(self.tag_dir)
        if self.reader is None:  # [Note: tensor-parallel resharding]
            blocks = getattr(self.state, "tp_blocks", {})  # [Note: fused sub-parameters] in tp/plan.py
            self.reader = tensor_parallel_reader(self.opened, self.catalog.infos, self.caller_split, blocks)
        return self.reader

    def close(self) -> None:
        self._delivered = self.wrote
        if self.opened is not None:
            self.opened.close()
        self.opened = self.reader = None

    @contextlib.contextmanager
    def held(self) -> Iterator[CheckpointReader]:
        try:
            yield self.open()
        finally:
            self.close()

    @property
    def wrote(self) -> bool:
        """Whether anything was written into the engine: a read reached a tensor, or counters were set."""
        readers = [r for r in (self.opened, self.reader) if r is not None]
        return self.touched or any(r.delivered for r in readers) or self._delivered


def plan_load(
    engine: CheckpointableEngine,
    tag_dir: str,
    universal: bool,
    strict: bool,
    keep_open: bool,
    reads: Reads,
    custom: bool = False,
) -> LoadPlan:
    """The checks a load can make before it writes, so that a checkpoint refused on any rank is refused before any rank
    writes. `keep_open`: keep the reader for `load_into` (else it is opened again there, in this rank's turn);
    `reads`: which of the files the load will open; `custom`: a custom load function places the module weights
    ([Note: custom_load_fn]), their names need not match."""
    opened = UniversalReader(tag_dir) if universal else CheckpointReader(tag_dir)
    try:
        if not universal:
            check_loadable(opened.metadata, tag_dir, engine)
            check_files(opened.metadata, tag_dir, engine.topology.rank, reads, node_local(engine) is not None)
        state = engine_state(engine)
        catalog = catalog_module(
            engine.module,
            state.sharded_params() if state is not None else {},
            shapes=full_shapes(state),
            peers=peer_tensors(state),
        )
        caller_split = bool(getattr(state, "caller_split", False))
        plan = LoadPlan(tag_dir, universal, caller_split, state, catalog, {}, [], {}, opened)
        reader = plan.open()
        plan.mapping, plan.missing = check_module_keys(reader.metadata, catalog, strict and not custom, custom)
        plan.blob = torch.load(io.BytesIO(reader.read_small(ENGINE_STATE_FILE)), map_location="cpu", weights_only=False)
    except BaseException:
        opened.close()
        raise
    if not keep_open:
        plan.close()
    return plan


def load_into(
    engine: CheckpointableEngine,
    plan: LoadPlan,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[dict[str, Any], bool, int]:
    """Restore this rank's state; returns (client_state, whether parameters must be re-published, what was restored:
    `MODULE`, `TRAINING` or `OPTIMIZER` from torn.py, -1 when some module weights were not). The tensors first, then
    the counters: a file that cannot be opened stops the load before anything was written."""
    with plan.held() as reader:
        return _load_tensors_and_state(
            engine, plan, reader, load_optimizer_states, load_lr_scheduler_states, load_module_only
        )


def _load_tensors_and_state(
    engine: CheckpointableEngine,
    plan: LoadPlan,
    reader: CheckpointReader,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[dict[str, Any], bool, int]:
    state, blob = plan.state, plan.blob
    meta = reader.metadata
    if plan.module_by_name:
        load_module_weights(reader, plan.catalog, state, plan.mapping)
    optimizer_too = (
        not load_module_only and load_optimizer_states and state is not None and engine.basic_optimizer is not None
    )
    if optimizer_too and meta.optimizer is None:
        log_rank(logger, 30, "the checkpoint has no optimizer state; the optimizer starts fresh")
        optimizer_too = False
    master_loaded = optimizer_too and bool(engine.config.zero_optimization.load_from_fp32_weights)
    if not plan.module_by_name and int(engine.config.zero_optimization.stage) == 0:  # [Note: custom_load_fn]
        master_loaded = master_loaded and engine.precision.compute_dtype != torch.float32  # fp32: the parameters
    ckpt_group: dict[int, int] = {}
    for part in state.parts() if state is not None else []:  # one part in memory at a time
        with part.hold(True):
            if plan.module_by_name:
                fill_targets(reader, part.model_targets(), plan.mapping)
            if optimizer_too:
                assert engine.basic_optimizer is not None
                load_optimizer_state(reader, engine.basic_optimizer, part, plan.mapping, master_loaded, ckpt_group)
            if engine.strategy is not None and not master_loaded:
                part.refresh_master()
    level = -1 if plan.missing else MODULE
    if not load_module_only:
        plan.touched = True
        if optimizer_too and engine.loss_scaler is not None and blob["loss_scaler"] is not None:
            engine.loss_scaler.load_state_dict(blob["loss_scaler"])
        if _restore_training_state(engine, reader, blob, load_lr_scheduler_states) and level == MODULE:
            level = TRAINING
            if optimizer_too or state is None or engine.basic_optimizer is None:
                level = OPTIMIZER
    publish = False
    if state is not None and engine.strategy is not None:
        # Module weights stored in another dtype than this engine computes in, or not read (a custom load function
        # wrote them, [Note: custom_load_fn]): rebuild them from the restored fp32 masters.
        publish = master_loaded and (meta.compute_dtype != compute_dtype_name(engine) or not plan.module_by_name)
    client_state: dict[str, Any] = blob["client_state"]
    return client_state, publish, level
