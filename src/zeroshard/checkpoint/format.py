"""The on-disk checkpoint format: directory layout, file names, and the metadata schema.

[Note: checkpoint format]
```
<save_dir>/latest                         the tag of the newest complete checkpoint (text)
<save_dir>/<tag>/metadata.json            written last: format version, world size, stage, dtypes,
                                          every tensor's name/shape/dtype, the piece map, file checksums
<save_dir>/<tag>/model/rankNNNNN.safetensors   module weights (compute dtype), the pieces rank NNNNN holds
<save_dir>/<tag>/optim/rankNNNNN.safetensors   fp32 master weights and elementwise optimizer state
<save_dir>/<tag>/rng/rankNNNNN.json            that rank's torch / numpy / python RNG states
<save_dir>/<tag>/engine_state.pt               rank 0: client_state, lr scheduler, loss scaler, sampler
```
The unit of storage is a *piece*: elements [begin, end) of one flattened tensor, named by its
`state_dict` key. A rank writes the pieces it owns (stages 1/2: its slices of every bucket; stage 0:
rank 0 everything); tensors no strategy shards (buffers, frozen parameters) are written whole by rank 0.
The model file holds piece `name[begin:end]`; the optimizer file holds `master:name[begin:end]` and one
`<state key>:name[begin:end]` per elementwise optimizer state (Adam's exp_avg, exp_avg_sq, ...).
Optimizer scalars (Adam's step) and group options (lr, betas, ...) are in metadata.json.

Nothing in the format refers to buckets, padding or ranks' shard offsets: a reader asks for any range
of any tensor and gets it from whichever pieces overlap it. That is what makes loading into another
world size or stage (0-3) a matter of each rank reading the ranges it owns under its new layout, and
what lets a stage-3 strategy write and read the same files (its pieces are per-parameter partitions).
"""

from __future__ import annotations

import glob
import json
import math
import os
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

from zeroshard.checkpoint.errors import CheckpointError

FORMAT_NAME = "zeroshard-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
# [Note: metadata checksum] metadata.json carries a CRC-32 of its own text without this key (its first entry), so a
# changed byte (an lr, a shape) is refused at load by name instead of loading silently; checkpoints written before
# the checksum existed load unverified.
_CHECKSUM_KEY = "metadata_crc32"
LATEST_FILE = "latest"
ENGINE_STATE_FILE = "engine_state.pt"
MASTER = "master"  # the state key of fp32 master weights in optimizer files


def model_file(rank: int, part: str = "") -> str:
    """`part`: a state part's suffix ([Note: state parts]); a rank's pieces may span several files."""
    return f"model/rank{rank:05d}{part}.safetensors"


def optim_file(rank: int, part: str = "") -> str:
    return f"optim/rank{rank:05d}{part}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng/rank{rank:05d}.json"


def piece_key(name: str, begin: int, end: int, state: str | None = None) -> str:
    """`wte.weight[0:512]` in model files, `exp_avg:wte.weight[0:512]` in optimizer files."""
    key = f"{name}[{begin}:{end}]"
    return key if state is None else f"{state}:{key}"


@dataclass(frozen=True)
class TensorInfo:
    """One `state_dict` entry (a canonical name: tied aliases point to it)."""

    shape: tuple[int, ...]
    dtype: str  # as stored in the model files (the compute dtype for parameters)
    kind: str  # "param" | "buffer"
    trainable: bool  # has fp32 master weights and optimizer state in the optimizer files
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class PieceRef:
    """Elements [begin, end) of a tensor, stored in `file` (relative to the tag directory)."""

    file: str
    begin: int
    end: int


@dataclass
class OptimizerInfo:
    """What is needed to rebuild the optimizer state of any layout."""

    cls: str
    elementwise: dict[str, str]  # state key -> dtype, stored per piece like the master weights
    groups: list[dict[str, Any]]  # {"options": {...}, "params": [names], "scalars": {key: value record}}


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_COUNTER_KEYS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def _require(block: Any, keys: tuple[str, ...], where: str) -> None:
    """A KeyError naming `where.key` for the first of `keys` the metadata's `block` lacks (caught by `from_json`):
    a load reads them after writing tensors, so they are checked before anything is written."""
    if not isinstance(block, dict):
        raise TypeError(f"{where} is not an object")
    for key in keys:
        if key not in block:
            raise KeyError(f"{where}.{key}")


@dataclass
class CheckpointMetadata:
    """Everything `metadata.json` says; see [Note: checkpoint format]."""

    tag: str
    world_size: int
    zero_stage: int
    compute_dtype: str
    library_version: str
    torch_version: str
    batch: dict[str, int]
    counters: dict[str, int]
    tensors: dict[str, TensorInfo]
    aliases: dict[str, str]  # alias state_dict key -> canonical key (tied weights)
    excluded: list[str]  # frozen parameters left out with exclude_frozen_parameters
    model_pieces: dict[str, list[PieceRef]]
    optim_pieces: dict[str, list[PieceRef]]
    optimizer: OptimizerInfo | None
    files: dict[str, dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """The document, with a CRC-32 of its own text ([Note: metadata checksum])."""
        doc: dict[str, Any] = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}
        body = asdict(self)
        body["tensors"] = {n: {**asdict(t), "shape": list(t.shape)} for n, t in self.tensors.items()}
        body["model_pieces"] = _pieces_to_json(self.model_pieces)
        body["optim_pieces"] = _pieces_to_json(self.optim_pieces)
        doc.update(body)
        checksum = f"{zlib.crc32(_readable_json(doc).encode()):08x}"
        return _readable_json({_CHECKSUM_KEY: checksum, **doc})

    @classmethod
    def from_json(cls, text: str, path: str) -> CheckpointMetadata:
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e}); the file is corrupted") from None
        if isinstance(doc, dict) and _CHECKSUM_KEY in doc:
            stored = doc.pop(_CHECKSUM_KEY)
            if stored != f"{zlib.crc32(_readable_json(doc).encode()):08x}":
                raise CheckpointError(
                    f"{path}: checksum mismatch (the metadata was changed or damaged after the save); "
                    "load another checkpoint"
                )
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointError(f'{path}: not a zeroshard checkpoint (no "format": "{FORMAT_NAME}")')
        version = doc.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: checkpoint format version {version} is newer than this zeroshard reads "
                f"({FORMAT_VERSION}); upgrade zeroshard"
            )
        try:
            optimizer = doc["optimizer"]
            _require(doc["batch"], _BATCH_KEYS, "batch")
            _require(doc["counters"], _COUNTER_KEYS, "counters")
            for index, group in enumerate(optimizer["groups"] if optimizer is not None else []):
                _require(group, ("options", "params", "scalars"), f"optimizer.groups[{index}]")
            return cls(
                tag=doc["tag"],
                world_size=int(doc["world_size"]),
                zero_stage=int(doc["zero_stage"]),
                compute_dtype=doc["compute_dtype"],
                library_version=doc["library_version"],
                torch_version=doc["torch_version"],
                batch=dict(doc["batch"]),
                counters=dict(doc["counters"]),
                tensors={n: TensorInfo(**{**t, "shape": tuple(t["shape"])}) for n, t in doc["tensors"].items()},
                aliases=dict(doc["aliases"]),
                excluded=list(doc["excluded"]),
                model_pieces=_pieces_from_json(doc["model_pieces"]),
                optim_pieces=_pieces_from_json(doc["optim_pieces"]),
                optimizer=None if optimizer is None else OptimizerInfo(**optimizer),
                files=dict(doc["files"]),
                extra=dict(doc.get("extra", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: metadata is incomplete or malformed ({e!r})") from None


def _readable_json(doc: dict[str, Any]) -> str:
    """One line per top-level key, and per entry of the big maps (tensors, pieces, files)."""
    lines = []
    for key, value in doc.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict | list) for v in value.values()):
            inner = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            lines.append(f" {json.dumps(key)}: {{\n{inner}\n }}")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _pieces_to_json(pieces: dict[str, list[PieceRef]]) -> dict[str, list[list[Any]]]:
    return {name: [[p.file, p.begin, p.end] for p in refs] for name, refs in pieces.items()}


def _pieces_from_json(doc: dict[str, list[list[Any]]]) -> dict[str, list[PieceRef]]:
    return {name: [PieceRef(str(f), int(b), int(e)) for f, b, e in refs] for name, refs in doc.items()}


def read_metadata(tag_dir: str) -> CheckpointMetadata:
    path = os.path.join(tag_dir, METADATA_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); the file is corrupted") from None
    except FileNotFoundError:
        if os.path.isfile(os.path.join(tag_dir, "zero", "optimizer_state.pt")):  # ds_to_universal's output
            raise CheckpointError(
                f'{tag_dir}: a DeepSpeed universal checkpoint; load it with "checkpoint": {{"load_universal": true}} '
                "in the config ([Note: universal checkpoints])"
            ) from None
        if glob.glob(os.path.join(glob.escape(tag_dir), "*model_states.pt")):
            raise CheckpointError(
                f"{tag_dir}: a DeepSpeed checkpoint, not a zeroshard one: convert it with `python -m "
                f"deepspeed.checkpoint.ds_to_universal --input_folder {tag_dir} --output_folder {tag_dir}_universal "
                '--inject_missing_state` and load that with "checkpoint": {"load_universal": true} ([Note: universal '
                "checkpoints])"
            ) from None
        raise CheckpointError(
            f"{path}: missing; {tag_dir} is not a complete zeroshard checkpoint (a save that was interrupted "
            "never produces a directory named after its tag, so this one was made by something else)"
        ) from None
    return CheckpointMetadata.from_json(text, path)
