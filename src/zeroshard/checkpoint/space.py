"""How many bytes a checkpoint save writes and whether the filesystems hold them: checked on every rank before
anything is written ([Note: checkpoint space]), and named in the error when a write still fills the disk."""

from __future__ import annotations

import errno
import os
import shutil
import socket
from typing import Any

import torch

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.node_local import node_local
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.checkpoint.state import ShardedState


def describe_write_error(error: Exception, tmp_dir: str, need: int) -> str:
    """One line; a full disk names the directory, the bytes this rank writes and what is free; any other failed
    write (a quota, a file-size limit, a read-only or failing disk) the file and the directory."""
    folder = os.path.dirname(tmp_dir)
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        free = free_bytes(folder)
        return (
            f"no space left on the device of {folder}: this rank writes about {need / 2**20:.1f} "
            f"MiB and {free / 2**20:.1f} MiB are free; free space or save elsewhere"
        )
    if isinstance(error, OSError) and error.errno in _WRITE_ERRNOS:
        where = error.filename or folder
        return (
            f"writing {where} failed: {_WRITE_ERRNOS[error.errno]} ({error.strerror}); this rank writes about "
            f"{need / 2**20:.1f} MiB into {folder}: {_WRITE_ADVICE[error.errno]}"
        )
    return f"{type(error).__name__}: {error}"


_WRITE_ERRNOS = {
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "a file grew past the largest this process may write",
    errno.EROFS: "the filesystem is read-only",
    errno.EIO: "the device reported an I/O error",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
_WRITE_ADVICE = {
    errno.EDQUOT: "free quota (old checkpoints) or save elsewhere",
    errno.EFBIG: "raise the limit (ulimit -f) or save elsewhere",
    errno.EROFS: "save to a writable folder",
    errno.EIO: "check the disk, save elsewhere",
    errno.EACCES: "make the folder writable for this user or save elsewhere",
    errno.EPERM: "make the folder writable for this user or save elsewhere",
}


def rank_bytes(
    state: ShardedState | None,
    optimizer: torch.optim.Optimizer | None,
    leader: bool = False,
    exclude_frozen: bool = False,
) -> int:
    """What this rank's checkpoint files hold: its model pieces (without the frozen ones `exclude_frozen` leaves out),
    and its optimizer pieces as they are kept (the master and each elementwise optimizer state tensor, Adam's two
    once it has stepped, in their dtypes: fp32, or bf16 with [Note: bf16 master weights]). From shapes and dtypes
    only: nothing is read in from NVMe."""
    if state is None:
        return 0
    skip: frozenset[int] = getattr(state, "frozen_ids", frozenset()) if exclude_frozen else frozenset()
    total = state.model_bytes_to_save(skip)
    if optimizer is not None and (state.writes_optim or leader):  # `leader`: a node-local node's leader
        per_element = max((_element_bytes(optimizer, p) for p in _optimizer_params(optimizer)), default=4)
        pieces = getattr(state, "optim_pieces_to_save", state.optim_pieces)()  # (MoE at stage 0: its parts' writers)
        total += per_element * sum(p.end - p.begin for p in pieces)
    return total


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _element_bytes(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> int:
    """Bytes per element of `param` (a master) and its elementwise optimizer state."""
    state = optimizer.state.get(param, {})
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == param.numel()]
    return param.element_size() + sum(v.element_size() for v in tensors)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged process can still write on `path`'s filesystem (the tests replace it)."""
    return shutil.disk_usage(path).free


def _existing_ancestor(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def bytes_to_write(engine: CheckpointableEngine, state: ShardedState | None, exclude_frozen: bool = False) -> int:
    """This rank's shard files, plus (rank 0) the tensors no strategy shards, which rank 0 writes whole; node-local,
    each node's leader writes those, the module weights whole where every rank loads them whole, and the optimizer
    state where one rank writes it for all ([Note: node-local checkpoints])."""
    placement = node_local(engine)
    total = rank_bytes(state, engine.basic_optimizer, placement is not None and placement.leader, exclude_frozen)
    if placement.leader if placement is not None else engine.topology.rank == 0:
        sharded = state.sharded_params() if state is not None else {}
        frozen = [p for p in engine.module.parameters() if id(p) not in sharded and not p.requires_grad]
        frozen = [] if exclude_frozen else frozen  # (unsharded frozen parameters are what it leaves out)
        total += sum(t.numel() * t.element_size() for t in [*frozen, *engine.module.buffers()])
        if placement is not None and state is not None and state.loads_whole:
            total += sum(p.numel() * p.element_size() for p in engine.module.parameters() if id(p) in sharded)
    return total


def space_report(root: str, need: int) -> dict[str, Any]:
    """What the start phase tells the other ranks about this rank's writes: bytes, filesystem, free bytes."""
    probe = _existing_ancestor(root)
    return {"bytes": need, "fs": f"{socket.gethostname()}:{os.stat(probe).st_dev}", "free": free_bytes(probe)}


def check_space(hello: list[dict[str, Any]], root: str) -> None:
    """[Note: checkpoint space]
    Every rank writes its shards at the same time, so a filesystem the ranks of a node share must hold all of
    their bytes, not one rank's: each rank posts its bytes, filesystem (host, device) and free bytes in the
    start phase, and every rank refuses the save the same way, before anything is written, when a
    filesystem's ranks need more than it has free. (Without it, two ranks whose shards each fit but together
    do not fill the disk halfway through the save.)"""
    groups: dict[str, list[int]] = {}
    for rank, h in enumerate(hello):
        groups.setdefault(h["fs"], []).append(rank)
    for fs, ranks in groups.items():
        need = sum(hello[r]["bytes"] for r in ranks)
        free = min(hello[r]["free"] for r in ranks)
        if need > free and free == 0:  # (/sys, /proc, a read-only mount: "Free 0.0 MiB" said nothing useful)
            raise CheckpointError(
                f"save_checkpoint: the filesystem of {root} (host {fs.rsplit(':', 1)[0]}) has no free bytes at all: "
                "a full disk, or one nothing can be saved to (read-only, or virtual as /sys and /proc); nothing was "
                "written. Save elsewhere."
            )
        if need > free:
            host = fs.rsplit(":", 1)[0]
            raise CheckpointError(
                f"save_checkpoint: not enough space in {root} (host {host}): rank(s) {ranks} write about "
                f"{need / 2**20:.1f} MiB ({need} bytes) to that filesystem at once and {free / 2**20:.1f} MiB are "
                f"free; nothing was written. Free {(need - free) / 2**20:.1f} MiB or save elsewhere."
            )
