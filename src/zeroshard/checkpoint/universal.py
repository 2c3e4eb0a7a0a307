"""DeepSpeed universal checkpoints (`"checkpoint": {"load_universal": true}`): resume a DeepSpeed run here.

[Note: universal checkpoints]
DeepSpeed's `ds_to_universal` turns a ZeRO checkpoint of any stage and data-parallel degree into one file per
parameter and state (`zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`, `step.pt`, each the whole tensor), the
optimizer's common state (`zero/optimizer_state.pt`: parameter groups, loss scaler) and the model-states file(s)
(module weights and buffers in the compute dtype, parameter groups by name, lr scheduler, counters, the client's
own keys). `UniversalReader` answers the same questions as a zeroshard checkpoint's `CheckpointReader` from those
files, so `load_checkpoint` restores it by the same path, onto any stage and world size: every rank reads the
ranges it owns. Not carried over: RNG states (a universal checkpoint has none), a data sampler's position (DeepSpeed
stores none without its own loader), and tensor-parallel slicing (a checkpoint of more than one model-parallel rank
is refused). Optimizer options are taken as hyperparameters only (`lr`, `betas`, `eps`, `weight_decay`, ...): the
implementation flags of DeepSpeed's optimizer (`fused`, `foreach`, ...) stay this engine's; from a ZeRO-3
checkpoint, whose parameter lists are per sub-group, none are (this engine's config stays). The converter extracts
Adam's moments only: another optimizer's state (an SGD momentum) starts fresh, the master weights are loaded. A
tied weight's second name is an alias of the first (DeepSpeed's `shared_params`). Without a tag, the tag comes from
`latest_universal` (the converter writes it), as in DeepSpeed.
"""

from __future__ import annotations

import glob
import io
import math
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import (
    ENGINE_STATE_FILE,
    MASTER,
    CheckpointMetadata,
    OptimizerInfo,
    TensorInfo,
)
from zeroshard.checkpoint.reshard import MODEL, OPTIM, CheckpointReader
from zeroshard.checkpoint.safetensors_io import dtype_name

MODEL_STATES = "mp_rank_00_model_states.pt"
MASTER_FILE = "fp32.pt"  # a parameter's fp32 master weights, in its zero/<name>/ folder
LATEST_UNIVERSAL = "latest_universal"  # ds_to_universal's pointer to its output, read when no tag is given
CONVERT = (
    "python -m deepspeed.checkpoint.ds_to_universal --input_folder <checkpoint>/<tag> --output_folder "
    "<checkpoint>/<tag>_universal --inject_missing_state"
)
# the model-states keys that are DeepSpeed's own; every other key is the client state save_checkpoint was given
_DEEPSPEED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "universal_checkpoint_info",
    }
)
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "momentum", "dampening", "nesterov")


def _load(path: str, mmap: bool = False) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except ImportError as e:  # DeepSpeed's own objects (its loss scaler, enums) are pickled in these files
        raise CheckpointError(f"{path}: cannot be read without {e.name or 'a module'} ({e}); install it") from None
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, AttributeError) as e:
        # a truncated or foreign file: torch.load's errors do not name it
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e}); the file is corrupted") from None


def _model_states(tag_dir: str) -> dict[str, Any]:
    path = os.path.join(tag_dir, MODEL_STATES)
    if not os.path.isfile(path):  # ZeRO-3 checkpoints name it by data-parallel rank
        candidates = sorted(glob.glob(os.path.join(glob.escape(tag_dir), "zero_pp_rank_0_*model_states.pt")))
        path = candidates[0] if candidates else path
    if not os.path.isfile(os.path.join(tag_dir, "zero", "optimizer_state.pt")) or not os.path.isfile(path):
        raise CheckpointError(
            f"{tag_dir}: not a DeepSpeed universal checkpoint (no zero/optimizer_state.pt or {MODEL_STATES}); "
            f"convert a DeepSpeed checkpoint with: {CONVERT}"
        )
    states = _load(path)
    if int(states.get("mp_world_size", 1)) > 1:
        raise CheckpointError(
            f"{tag_dir}: a universal checkpoint of {states['mp_world_size']} model-parallel ranks; zeroshard loads "
            "DeepSpeed universal checkpoints of data-parallel (ZeRO) runs only"
        )
    return states


def _checked(path: str, saved: Any, info: TensorInfo | None) -> torch.Tensor:
    """A per-parameter file's tensor, if it has its parameter's shape (`param_shapes`): a file copied from another
    parameter would load that one's values. ds_to_universal keeps the shape at ZeRO 1-2 and writes a ZeRO-3
    checkpoint's tensors flat, so a 1-D tensor of as many elements passes too."""
    tensor = saved.get("param") if isinstance(saved, dict) else saved
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"{path}: holds no tensor (a {type(tensor).__name__}); the file is corrupted")
    shape = tuple(tensor.shape)
    if info is not None and shape != info.shape and not (tensor.dim() == 1 and tensor.numel() == info.numel):
        raise CheckpointError(
            f"{path}: a tensor of shape {shape} where the parameter has {info.shape} ({MODEL_STATES}'s "
            "param_shapes); the file is another parameter's or was modified: convert the DeepSpeed checkpoint "
            "again with ds_to_universal"
        )
    return tensor


def _loss_scaler_state(scaler: Any) -> dict[str, Any] | None:
    """DeepSpeed's loss-scaler object in this engine's state_dict terms (None when it has no scale)."""
    if scaler is None or not hasattr(scaler, "cur_scale"):
        return None
    return {
        "cur_scale": float(scaler.cur_scale),
        "cur_iter": int(getattr(scaler, "cur_iter", 0)),
        "last_overflow_iter": int(getattr(scaler, "last_overflow_iter", -1)),
        "cur_hysteresis": int(getattr(scaler, "cur_hysteresis", getattr(scaler, "delayed_shift", 1))),
    }


class UniversalReader(CheckpointReader):
    """[Note: universal checkpoints] a DeepSpeed universal checkpoint through `CheckpointReader`'s interface."""

    def __init__(self, tag_dir: str):  # noqa: D107 - the base class's state is built here, not by its reader
        self.tag_dir = tag_dir
        self.delivered = False  # [Note: a torn load]
        self._states = _model_states(tag_dir)
        self._zero = os.path.join(tag_dir, "zero")
        self._common = _load(os.path.join(self._zero, "optimizer_state.pt"))
        self._cache: tuple[str, str, torch.Tensor] | None = None
        self._fragments: list[dict[str, torch.Tensor]] | None = None  # ZeRO-3 frozen parameters, per rank
        self._check_state_files()
        self.metadata = self._metadata()

    # -- what the checkpoint holds -------------------------------------------------------------------------
    def _state_file(self, name: str, state: str | None) -> str:
        return os.path.join(self._zero, name, f"{'fp32' if state in (None, MASTER) else state}.pt")

    def _check_state_files(self) -> None:
        """[Note: a universal checkpoint's missing files]
        ds_to_universal writes every trainable parameter's master weights (`fp32.pt`) and, per parameter, the
        optimizer state it had (Adam's `exp_avg.pt`, `exp_avg_sq.pt`). DeepSpeed's loader reads whichever files a
        folder holds, so a deleted one loads as nothing: the module's weights stay, a moment stays zero. Here a
        parameter without its `fp32.pt`, or without a state file the other parameters of its group (a
        `param_shapes` entry) have, is refused before anything is loaded. A checkpoint with no master weights at
        all loads the module weights, and one with no moments (another optimizer's run) the master weights only,
        as before ([Note: universal checkpoints])."""
        aliases = set(self._states.get("shared_params") or {})
        groups = [[n for n in group if n not in aliases] for group in self._trainable()]
        held = {n: self._held_states(n) for group in groups for n in group}
        masters = any(MASTER_FILE in files for files in held.values())
        for group in groups:
            wanted = set().union(*(held[n] for n in group)) | ({MASTER_FILE} if masters else set())
            missing = [(n, f) for n in group for f in sorted(wanted - held[n])]
            if missing:
                name, file = missing[0]
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                others = (
                    "every trainable parameter has" if file == MASTER_FILE else "the other parameters of its group have"
                )
                raise CheckpointError(
                    f"{os.path.join(self._zero, name, file)}: missing{more}, where {others} one; the universal "
                    f"checkpoint is incomplete: convert the DeepSpeed checkpoint again with {CONVERT}"
                )

    def _held_states(self, name: str) -> set[str]:
        """The master-weight and elementwise-state files of `name`'s folder (`step.pt` has a fallback, `_step`)."""
        folder = os.path.join(self._zero, name)
        files = os.listdir(folder) if os.path.isdir(folder) else []
        return {f for f in files if f.endswith(".pt") and f != "step.pt"}

    def _trainable(self) -> list[list[str]]:
        """Parameter names per `param_shapes` entry: an optimizer group at ZeRO 1-2, a sub-group at ZeRO-3."""
        shapes = self._states.get("param_shapes") or []
        return [list(group) for group in shapes]

    def _metadata(self) -> CheckpointMetadata:
        module = dict(self._states.get("module") or {})
        # a tied weight's second name (DeepSpeed's shared_params: that name -> the one holding the data) is an alias
        aliases = {k: v for k, v in (self._states.get("shared_params") or {}).items() if k != v}
        for alias in aliases:
            module.pop(alias, None)
        groups = self._trainable()
        trainable = {n for g in groups for n in g}
        buffers = set(self._states.get("buffer_names") or [])
        # ZeRO-3 saves partitioned placeholders in `module`: the shapes are in param_shapes / frozen_param_shapes
        shapes = {n: tuple(s) for g in self._states.get("param_shapes") or [] for n, s in g.items()}
        shapes |= {n: tuple(s) for n, s in (self._states.get("frozen_param_shapes") or {}).items()}
        tensors: dict[str, TensorInfo] = {}
        for name, tensor in module.items():
            kind = "buffer" if name in buffers else "param"
            shape = shapes.get(name, tuple(tensor.shape))
            tensors[name] = TensorInfo(shape, dtype_name(tensor.dtype), kind, name in trainable)
        for name in set(shapes) - set(tensors) - set(aliases):
            tensors[name] = TensorInfo(shapes[name], "float32", "param", name in trainable)
        return CheckpointMetadata(
            tag=os.path.basename(os.path.normpath(self.tag_dir)),
            world_size=int(self._states.get("dp_world_size", 1)),
            zero_stage=int(self._common.get("zero_stage", 0)),
            compute_dtype=self._compute_dtype(module, trainable),
            library_version=f"deepspeed {self._states.get('ds_version', '?')}",
            torch_version="",
            batch=self._batch(),
            counters=self._counters(),
            tensors=tensors,
            aliases=aliases,
            excluded=[],
            model_pieces={},
            optim_pieces={},
            optimizer=self._optimizer(groups),
            files={},
        )

    def _compute_dtype(self, module: dict[str, torch.Tensor], trainable: set[str]) -> str:
        dtypes = {dtype_name(t.dtype) for n, t in module.items() if n in trainable}
        return dtypes.pop() if len(dtypes) == 1 else "float32"

    def _batch(self) -> dict[str, int]:
        config = self._states.get("ds_config") or {}
        micro = int(config.get("train_micro_batch_size_per_gpu") or 1)
        gas = int(config.get("gradient_accumulation_steps") or 1)
        world = int(self._states.get("dp_world_size", 1))
        total = int(config.get("train_batch_size") or micro * gas * world)
        return {"train_batch_size": total, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}

    def _counters(self) -> dict[str, int]:
        """DeepSpeed's checkpoint keeps no micro-step count: a managed run made gradient_accumulation_steps of them per
        step, one whose script ended its own windows (`managed_gradient_accumulation: false`) one per `step()`."""
        steps = int(self._states.get("global_steps", 0))
        config = self._states.get("ds_config") or {}
        per_step = (
            self._batch()["gradient_accumulation_steps"] if config.get("managed_gradient_accumulation", True) else 1
        )
        return {
            "global_steps": steps,
            "global_samples": int(self._states.get("global_samples", 0)),
            "skipped_steps": int(self._states.get("skipped_steps", 0)),
            "micro_steps": steps * per_step,
        }

    def _optimizer(self, groups: list[list[str]]) -> OptimizerInfo | None:
        """Master weights always; Adam's moments and step when the checkpoint has them (DeepSpeed's converter
        extracts no other optimizer state: an SGD momentum starts from zero). Group options (lr, weight decay, ...)
        only when `param_shapes` lists the optimizer groups themselves: at ZeRO-3 it lists sub-groups, which do not
        say which group they belong to, and this engine's options stay."""
        saved = self._common.get("param_groups") or []
        if not groups or not os.path.isfile(self._state_file(groups[0][0], MASTER)):
            return None
        adam_groups = [bool(names) and os.path.isfile(self._state_file(names[0], "exp_avg")) for names in groups]
        adam = any(adam_groups)  # a group without moments: `has_state` says so, and its state starts fresh
        by_group = len(groups) == len(saved)
        info_groups = []
        for g, names in enumerate(groups):
            options = saved[g] if by_group else {}
            step = {"step": {"tensor": "float32", "value": self._step(names[0])}} if adam_groups[g] else {}
            info_groups.append(
                {"options": {k: options[k] for k in _HYPERPARAMETERS if k in options}, "params": names, "scalars": step}
            )
        config = self._states.get("ds_config") or {}
        return OptimizerInfo(
            cls=str((config.get("optimizer") or {}).get("type", "unknown")),
            elementwise={"exp_avg": "float32", "exp_avg_sq": "float32"} if adam else {},
            groups=info_groups,
        )

    def _step(self, name: str) -> float:
        """Adam's step count: the parameter's `step.pt` (ZeRO 1-2), else the one the common optimizer state keeps
        (ZeRO-3), else the steps applied (every applied step counts once)."""
        path = os.path.join(self._zero, name, "step.pt")
        if os.path.isfile(path):
            step = _load(path)
        else:
            states = (self._common.get("optimizer_state_dict") or {}).get("state") or {}
            first: dict[str, Any] = next(iter(states.values()), {})
            counters = self._counters()
            step = first.get("step", counters["global_steps"] - counters["skipped_steps"])
        return float(step.item() if isinstance(step, torch.Tensor) else step)

    # -- CheckpointReader's interface ------------------------------------------------------------------------
    def has(self, store: str, name: str) -> bool:
        if store == MODEL:
            return name in self.metadata.tensors
        return os.path.isfile(self._state_file(name, MASTER))

    def has_state(self, store: str, name: str, state: str) -> bool | None:
        return store == OPTIM and os.path.isfile(self._state_file(name, state))

    def _tensor(self, store: str, name: str, state: str | None) -> torch.Tensor:
        module = self._states.get("module") or {}
        info = self.metadata.tensors.get(name)
        if store == MODEL:
            if info is None:
                raise CheckpointError(f"{self.tag_dir}: the checkpoint has no model data for {name!r}")
            if name in module and module[name].numel() == info.numel:
                return module[name].reshape(-1)
        key = state or MASTER  # a ZeRO-3 placeholder, or a tensor only the zero/ files hold: their fp32 value
        if self._cache is None or self._cache[:2] != (name, key):
            path = self._state_file(name, state)
            if os.path.isfile(path):
                tensor = _checked(path, _load(path), info)
            elif store == MODEL and name in (self._states.get("frozen_param_shapes") or {}):
                tensor = self._frozen_zero3(name)
            else:
                raise CheckpointError(f"{path}: missing from the universal checkpoint")
            self._cache = (name, key, tensor.reshape(-1))
        return self._cache[2]

    def _frozen_zero3(self, name: str) -> torch.Tensor:
        """A frozen parameter of a ZeRO-3 checkpoint (ds_to_universal writes no file for it): each data-parallel
        rank's model-states file holds its partition (`frozen_param_fragments`); in rank order they are the
        flattened tensor, padded at the end."""
        if self._fragments is None:  # every rank's file once, memory-mapped: only the fragments read are paged in
            pattern = os.path.join(glob.escape(self.tag_dir), "zero_pp_rank_*_model_states.pt")
            files = sorted(glob.glob(pattern), key=lambda p: int(os.path.basename(p).split("_")[3]))
            self._fragments = [_load(path, mmap=True)["frozen_param_fragments"] for path in files]
        parts = [fragments[name].reshape(-1) for fragments in self._fragments]
        numel = math.prod(self._states["frozen_param_shapes"][name])
        return torch.cat(parts)[:numel]

    def read_range(
        self, store: str, name: str, begin: int, end: int, out: torch.Tensor, state: str | None = None
    ) -> None:
        flat = self._tensor(store, name, state)
        if end > flat.numel():
            raise CheckpointError(f"{self.tag_dir}: {name!r} has {flat.numel()} elements, [{begin}, {end}) asked")
        self.delivered = True
        out.copy_(flat[begin:end])

    def stored_dtype(self, store: str, name: str, state: str | None = None) -> torch.dtype:
        return self._tensor(store, name, state).dtype

    def stream(self, store: str, name: str, state: str | None = None) -> Iterator[torch.Tensor]:
        yield self._tensor(store, name, state)

    def read_small(self, rel: str) -> bytes:
        """The engine state (`load_checkpoint` reads no other small file from here: there are no RNG files)."""
        if rel != ENGINE_STATE_FILE:
            raise CheckpointError(f"{self.tag_dir}: a universal checkpoint has no {rel}")
        blob = {
            "client_state": {k: v for k, v in self._states.items() if k not in _DEEPSPEED_KEYS},
            "lr_scheduler": self._states.get("lr_scheduler"),
            "data_sampler": None,
            "loss_scaler": _loss_scaler_state(self._common.get("loss_scaler")),
        }
        buffer = io.BytesIO()
        torch.save(blob, buffer)
        return buffer.getvalue()

    def close(self) -> None:
        self._cache = None
        self._fragments = None
