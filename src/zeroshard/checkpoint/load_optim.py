"""The optimizer's part of `load_checkpoint`: fp32 masters and elementwise state from any layout, group options and
scalar state, and what a checkpoint of another optimizer kind leaves fresh."""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.checkpoint.format import MASTER
from zeroshard.checkpoint.reshard import OPTIM, CheckpointReader
from zeroshard.checkpoint.safetensors_io import dtype_from_name
from zeroshard.checkpoint.state import StatePart
from zeroshard.optim.state_dtype import state_dtype
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def _scalar(record: dict[str, Any], like: Any, device: torch.device) -> Any:
    if record["tensor"] is None:
        return record["value"]
    if isinstance(like, torch.Tensor):
        device = like.device
    value = torch.tensor(record["value"], dtype=dtype_from_name(record["tensor"]), device=device)
    return value.reshape(record["shape"]) if "shape" in record else value  # (checkpoints before it: 0-dim)


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
