"""One rank's files of a save: the tensors each file holds, written at once or, for a decoupled save, later.

`RankFiles` lists a file and writes it at once (the default), or only lists it (`deferred`) for the decoupled
writer to write on its thread ([Note: decoupled checkpoint writes] in decoupled.py). Either way the manifest (files,
sizes, CRCs, pieces) is what rank 0 merges into metadata.json. What must be read at the moment of the call (the RNG
state, the engine's scheduler/scaler/sampler state, scalar optimizer state) is taken into `RankSnapshot` and the
files' entries when the file is listed; the tensors are views, read when the file is written.
"""

from __future__ import annotations

import io
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroshard.checkpoint.atomic import fault_point, write_file
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import (
    ENGINE_STATE_FILE,
    MASTER,
    OptimizerInfo,
    model_file,
    optim_file,
    piece_key,
    rng_file,
)
from zeroshard.checkpoint.node_local import NodeLocal, model_pieces, writes_optim
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.checkpoint.rng import capture_rng_state
from zeroshard.checkpoint.safetensors_io import SafetensorsWriter, TensorSpec, dtype_name
from zeroshard.checkpoint.state import ModelPiece, OptimPiece, ShardedState


# -- optimizer state ------------------------------------------------------------------------------------
def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _scalar_record(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        # the shape too: a one-element state kept as shape (1,) (a client optimizer's step counter) comes back so
        record = {"value": value.item(), "tensor": dtype_name(value.dtype)}
        return record if value.dim() == 0 else {**record, "shape": list(value.shape)}
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


# -- the files ------------------------------------------------------------------------------------------
@dataclass
class RankManifest:
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    model_pieces: dict[str, list[list[Any]]] = field(default_factory=dict)
    optim_pieces: dict[str, list[list[Any]]] = field(default_factory=dict)
    elementwise: dict[str, str] = field(default_factory=dict)
    param_groups: dict[str, int] = field(default_factory=dict)  # parameter name -> optimizer group


@dataclass(frozen=True)
class RankSnapshot:
    """What a save reads from the engine at the call, not when its files are written."""

    rng: bytes
    engine_state: bytes | None  # rank 0 only


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


def take_snapshot(engine: CheckpointableEngine, client_state: dict[str, Any], shared_writer: bool) -> RankSnapshot:
    """`shared_writer`: this rank writes the engine state (rank 0; node-local: each node's leader)."""
    rng = json.dumps(capture_rng_state()).encode()
    return RankSnapshot(rng, _engine_state_bytes(engine, client_state) if shared_writer else None)


@dataclass(frozen=True)
class FileJob:
    rel: str
    entries: list[tuple[str, torch.Tensor]] | None = None  # a safetensors file of these tensors
    data: bytes | None = None  # else a plain file


class RankFiles:
    """This rank's files of one save under `tmp_dir`: written as they are added, or (`deferred`) by `write_all`."""

    def __init__(self, tmp_dir: str, rank: int, deferred: bool = False):
        self.tmp_dir, self.rank, self.deferred = tmp_dir, rank, deferred
        self.manifest = RankManifest()
        self.jobs: list[FileJob] = []
        self.bytes_written = 0
        self.seconds = 0.0  # spent writing

    def add(self, job: FileJob) -> None:
        if self.deferred:
            self.jobs.append(job)
        else:
            self._write(job)

    def write_all(self) -> None:
        while self.jobs:
            self._write(self.jobs.pop(0))  # drop each file's views once written

    def _write(self, job: FileJob) -> None:
        begin = time.perf_counter()
        path = os.path.join(self.tmp_dir, job.rel)
        if job.entries is not None:
            record = _write_safetensors(path, job.entries, self.rank)
        else:
            assert job.data is not None
            record = write_file(path, job.data)
        self.manifest.files[job.rel] = record
        self.bytes_written += int(record["bytes"])  # type: ignore[call-overload]
        self.seconds += time.perf_counter() - begin


def _write_safetensors(path: str, entries: list[tuple[str, torch.Tensor]], rank: int) -> dict[str, Any]:
    specs = [TensorSpec(key, t.dtype, (t.numel(),)) for key, t in entries]
    writer = SafetensorsWriter(path, specs)
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


def add_model_file(files: RankFiles, pieces: list[ModelPiece], part: str = "") -> None:
    if not pieces:
        return
    rel = model_file(files.rank, part)
    for p in pieces:
        files.manifest.model_pieces.setdefault(p.name, []).append([rel, p.begin, p.end])
    files.add(FileJob(rel, [(piece_key(p.name, p.begin, p.end), p.values) for p in pieces]))


def add_optim_file(
    files: RankFiles, optimizer: torch.optim.Optimizer, pieces: list[OptimPiece], part: str = ""
) -> None:
    if not pieces:
        return
    rel = optim_file(files.rank, part)
    manifest = files.manifest
    entries: list[tuple[str, torch.Tensor]] = []
    for p in pieces:
        elementwise = split_optimizer_state(optimizer, p.param)[0]
        entries.append((piece_key(p.name, p.begin, p.end, MASTER), p.view(p.param)))
        for key in sorted(elementwise):
            manifest.elementwise[key] = dtype_name(elementwise[key].dtype)
            entries.append((piece_key(p.name, p.begin, p.end, key), p.view(elementwise[key])))
        manifest.optim_pieces.setdefault(p.name, []).append([rel, p.begin, p.end])
        manifest.param_groups[p.name] = p.group
    files.add(FileJob(rel, entries))


def add_rank_files(
    engine: CheckpointableEngine,
    files: RankFiles,
    replicated: list[ModelPiece],
    state: ShardedState | None,
    snapshot: RankSnapshot,
    placement: NodeLocal | None = None,
    excluded: frozenset[str] = frozenset(),
) -> None:
    """This rank's model and optimizer pieces (`replicated`: the tensors no strategy shards, rank 0's), RNG state
    and (rank 0) engine state, part by part; `placement`: [Note: node-local checkpoints]; `excluded`: names
    exclude_frozen_parameters leaves out."""
    parts = state.parts() if state is not None else []
    if not parts:
        add_model_file(files, replicated)
    for i, part in enumerate(parts):  # one part in memory at a time ([Note: state parts])
        assert state is not None
        with part.hold(False):
            pieces = [p for p in model_pieces(part, state, placement) if p.name not in excluded]
            add_model_file(files, pieces + (replicated if i == 0 else []), part.suffix)
            if engine.basic_optimizer is not None and writes_optim(state, placement):
                owned = (part.optim_pieces_to_save or part.optim_pieces)()
                add_optim_file(files, engine.basic_optimizer, owned, part.suffix)
    files.add(FileJob(rng_file(files.rank), data=snapshot.rng))
    if snapshot.engine_state is not None:
        files.add(FileJob(ENGINE_STATE_FILE, data=snapshot.engine_state))
