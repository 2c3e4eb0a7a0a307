"""Consolidate a sharded checkpoint into one state_dict, or into Hugging Face-style safetensors shards.

DeepSpeed's names and arguments (`deepspeed.utils.zero_to_fp32`): `get_fp32_state_dict_from_zero_checkpoint`,
`load_state_dict_from_zero_checkpoint`, `convert_zero_checkpoint_to_fp32_state_dict`. Trainable parameters
come from the fp32 master weights; buffers and frozen parameters from the model weights.

[Note: streaming export]
`convert_zero_checkpoint_to_state_dict` never holds a tensor whole: it plans the shards from the
metadata (names, shapes, dtypes are known before any byte is read), writes each shard's header, then
copies every tensor from its pieces in chunks of `safetensors_io.CHUNK_BYTES`, converting the dtype per
chunk. Peak memory is a few chunks, whatever the model or tensor size (the `--format bin` path is the
exception: torch.save needs each shard in memory, so it is bounded by `max_shard_size`).

A checkpoint of tensor-parallel slices (`<key>.tp<j>of<N>`, [Note: tensor-parallel checkpoints]) is exported whole:
each slice set is read as one tensor under its own key, joined along the split dimension the checkpoint records
(`tp/reshard.py` `whole_reader`, the load path's reslicing at autotp_size 1; a fused layer's parts put back in order).
A checkpoint that does not record it (an mpu's own split, or written before it was recorded) is refused in one line
(the export used to write slice 0 under the whole tensor's name).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.checkpoint.atomic import fsync_dir, write_file
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import MASTER, METADATA_FILE, CheckpointMetadata
from zeroshard.checkpoint.load import resolve_tag_dir
from zeroshard.checkpoint.reshard import MODEL, OPTIM, CheckpointReader
from zeroshard.checkpoint.safetensors_io import SafetensorsWriter, TensorSpec, dtype_from_name
from zeroshard.precision.dtypes import DTYPES
from zeroshard.tp.reshard import whole_reader
from zeroshard.utils.chunks import greedy_chunks


def resolve_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None) -> str:
    """The tagged directory: `checkpoint_dir` itself if it holds metadata.json, else `<dir>/<tag or latest>`."""
    root = os.fspath(checkpoint_dir)
    if not os.path.isdir(root):
        what = "is a file, not a folder" if os.path.exists(root) else "does not exist"
        raise CheckpointError(f"{root}: {what}; pass the save_dir of save_checkpoint (or one tagged checkpoint folder)")
    if tag is None and os.path.isfile(os.path.join(root, METADATA_FILE)):
        return root
    if tag is None and _deepspeed_files(root):
        raise _deepspeed_checkpoint(root, os.path.dirname(os.path.abspath(root)))
    tag_dir = resolve_tag_dir(root, tag)
    if tag_dir is None:
        raise CheckpointError(f"{root}: no 'latest' file and no tag given; pass tag= (e.g. 'global_step100')")
    if not os.path.isfile(os.path.join(tag_dir, METADATA_FILE)) and _deepspeed_files(tag_dir):
        raise _deepspeed_checkpoint(tag_dir, root)
    return tag_dir


def _deepspeed_files(folder: str) -> bool:
    return bool(glob.glob(os.path.join(glob.escape(folder), "*model_states.pt")))


def _deepspeed_checkpoint(tag_dir: str, save_dir: str) -> CheckpointError:
    """What can export a DeepSpeed checkpoint, which this module does not read: DeepSpeed's own script, or a resume
    here ([Note: universal checkpoints]) and a zeroshard save (format.py's refusal advises a resume only)."""
    resume = '"checkpoint": {"load_universal": true}, save_checkpoint, and export that checkpoint'
    if os.path.isfile(os.path.join(tag_dir, "zero", "optimizer_state.pt")):
        return CheckpointError(
            f"{tag_dir}: a DeepSpeed universal checkpoint, which zeroshard's export does not read: resume it with "
            f"{resume}, or export the DeepSpeed checkpoint it was converted from with DeepSpeed's zero_to_fp32"
        )
    tag = os.path.basename(os.path.normpath(tag_dir))
    return CheckpointError(
        f"{tag_dir}: a DeepSpeed checkpoint, which zeroshard's export does not read: export it with DeepSpeed's "
        f"`python -m deepspeed.utils.zero_to_fp32 {save_dir} OUT -t {tag}` (the zero_to_fp32.py DeepSpeed saved "
        f"beside `latest` does the same), or convert it with ds_to_universal, resume it with {resume}"
    )


def _source(reader: CheckpointReader, name: str) -> tuple[str, str | None]:
    """Where the fp32 values of `name` live: master weights if it has them, else the model weights."""
    if reader.metadata.tensors[name].trainable and reader.has(OPTIM, name):
        return OPTIM, MASTER
    return MODEL, None


def _exported_names(meta: CheckpointMetadata, exclude_frozen: bool) -> list[str]:
    return [
        name
        for name, info in meta.tensors.items()
        if not (exclude_frozen and info.kind == "param" and not info.requires_grad and not info.trainable)
    ]


_OUTPUT_DTYPES = {**DTYPES, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def output_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """An output dtype as DeepSpeed's conversion takes it: a torch dtype or its name ("bf16", "bfloat16",
    "torch.bfloat16"), fp32, fp16 or bf16."""
    name = dtype.removeprefix("torch.").lower() if isinstance(dtype, str) else None
    resolved = _OUTPUT_DTYPES.get(name) if name is not None else dtype
    if resolved not in _OUTPUT_DTYPES.values():
        raise ValueError(f"output dtype {dtype!r}: choose one of {', '.join(sorted(_OUTPUT_DTYPES))}")
    assert isinstance(resolved, torch.dtype)
    return resolved


def _out_dtype(stored: str, dtype: torch.dtype) -> torch.dtype:
    kept = dtype_from_name(stored)
    return dtype if kept.is_floating_point else kept


class _OpenCheckpoint:
    """One reader for every `LazyTensor` of a lazy state dict: opened at the first read, closed with the last tensor
    (each read opened its own, re-checking every piece and header: quadratic in the number of tensors)."""

    def __init__(self, tag_dir: str, meta: CheckpointMetadata) -> None:
        self.tag_dir, self.meta = tag_dir, meta
        self._reader: CheckpointReader | None = None

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if self._reader is None:
            self._opened = CheckpointReader(self.tag_dir)
            self._reader = whole_reader(self._opened)  # (tensor-parallel slices joined, as the eager export)
        store, state = _source(self._reader, name)
        return self._reader.read_tensor(store, name, dtype=dtype, state=state)

    def __del__(self) -> None:
        if self._reader is not None:
            self._opened.close()


class LazyTensor:
    """One consolidated tensor of a checkpoint, read only by `contiguous()` (DeepSpeed's `lazy_mode` tensors): `shape`
    and `dtype` are known from the metadata, so a caller can plan (shards, say) before any byte is read. It reads the
    checkpoint's files when asked (DeepSpeed's hold the rank files in memory): keep them until then."""

    def __init__(self, source: _OpenCheckpoint, name: str) -> None:
        self._source, self.name = source, name
        self.shape = torch.Size(source.meta.tensors[name].shape)
        self.dtype = _out_dtype(source.meta.tensors[name].dtype, torch.float32)

    def contiguous(self) -> torch.Tensor:
        """The whole tensor, on the CPU (a new tensor per call)."""
        return self._source.read(self.name, self.dtype)


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, Any]:
    """The consolidated fp32 state_dict (CPU). Tied names share one tensor, as in the module. With `lazy_mode`, as
    DeepSpeed's, `LazyTensor`s that read their tensor at `.contiguous()` (`to_torch_tensor` turns the dict into
    tensors): one tensor in memory at a time.

    Example:
        >>> sd = get_fp32_state_dict_from_zero_checkpoint("ckpt")  # doctest: +SKIP
        >>> model.load_state_dict(sd)  # doctest: +SKIP
    """
    tag_dir = resolve_checkpoint(checkpoint_dir, tag)
    with CheckpointReader(tag_dir) as opened:
        reader = whole_reader(opened)
        meta = reader.metadata
        result: dict[str, Any] = {}
        source = _OpenCheckpoint(tag_dir, meta)
        for name in _exported_names(meta, exclude_frozen_parameters):
            if lazy_mode:
                result[name] = LazyTensor(source, name)
            else:
                store, state = _source(reader, name)
                dtype = _out_dtype(meta.tensors[name].dtype, torch.float32)
                result[name] = reader.read_tensor(store, name, dtype=dtype, state=state)
        for alias, canonical in meta.aliases.items():
            if canonical in result:
                result[alias] = result[canonical]
    return result


def to_torch_tensor(
    state_dict: dict[str, Any], return_empty_tensor: bool = False, dtype: torch.dtype | str | None = None
) -> dict[str, torch.Tensor]:
    """A lazy state_dict's tensors (DeepSpeed's `to_torch_tensor`): read (or, with `return_empty_tensor`, allocated
    empty, for planning), floating ones in `dtype` if given; names sharing a tensor keep sharing one."""
    out_dtype = None if dtype is None else output_dtype(dtype)
    out: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for name, lazy in state_dict.items():
        if id(lazy) in first:
            out[name] = out[first[id(lazy)]]
            continue
        first[id(lazy)] = name
        target = out_dtype if out_dtype is not None and lazy.dtype.is_floating_point else lazy.dtype
        if return_empty_tensor:
            out[name] = torch.empty(lazy.shape, dtype=target)
        else:
            out[name] = lazy.contiguous().to(target)
    return out


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> nn.Module:
    """Move `model` to CPU and copy the checkpoint's fp32 weights into it (strict=False: names only one side has are
    left alone). Like DeepSpeed's `load_state_dict(strict=False)`, a shape that differs is refused, naming the
    tensors; every tensor is read and checked before the first is copied, so a refusal leaves the model as it was
    (it holds one copy of the weights, in the model's dtypes, meanwhile, as DeepSpeed's state dict does).

    Like DeepSpeed's, the model is then a plain module: build a new engine to train it again.
    """
    tag_dir = resolve_checkpoint(checkpoint_dir, tag)
    targets = {key: (tuple(t.shape), t.dtype) for key, t in model.state_dict(keep_vars=True).items()}
    with CheckpointReader(tag_dir) as opened:
        reader = whole_reader(opened)
        meta = reader.metadata
        names = {key: key if key in meta.tensors else meta.aliases.get(key) for key in targets}
        matched = {key: name for key, name in names.items() if name is not None}
        _refuse_other_shapes(
            tag_dir, {key: (targets[key][0], meta.tensors[name].shape) for key, name in matched.items()}
        )
        values: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        for key, name in matched.items():
            dtype = targets[key][1]
            if (name, dtype) not in values:  # tied names read once
                store, state = _source(reader, name)
                flat = torch.empty(meta.tensors[name].numel, dtype=dtype)
                reader.read_range(store, name, 0, flat.numel(), flat, state)
                values[name, dtype] = flat.view(meta.tensors[name].shape)
    model = model.cpu()
    with torch.no_grad():
        for key, tensor in model.state_dict(keep_vars=True).items():
            if key in matched:
                tensor.data.copy_(values[matched[key], tensor.dtype])
    return model


def _refuse_other_shapes(tag_dir: str, shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """torch's size-mismatch error of `load_state_dict(strict=False)`, in one line."""
    differ = [
        f"{key} {ours} in the model, {theirs} in the checkpoint"
        for key, (ours, theirs) in shapes.items()
        if ours != theirs
    ]
    if differ:
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise CheckpointError(
            f"{tag_dir}: the model's shapes differ from the checkpoint's, nothing was loaded: {'; '.join(differ[:3])}"
            f"{more}; build the model with the configuration the checkpoint was trained with"
        )


# -- sharded output --------------------------------------------------------------------------------------------
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20}
_UNITS.update({"GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """`"5GB"` -> 5_000_000_000 (decimal units, binary with `iB`), as Hugging Face parses max_shard_size."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size.upper())
    if match is None:
        raise ValueError(f"max_shard_size {size!r}: expected a number of bytes or a size such as '5GB' or '500MiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def plan_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Hugging Face's split: fill shards in order; a tensor larger than a shard gets one of its own."""
    chunks = greedy_chunks([nbytes for _, nbytes in sizes], max_bytes, close="before", oversize_alone=True)
    return [[sizes[i][0] for i in chunk] for chunk in chunks]


def _shard_names(count: int, safetensors: bool) -> tuple[list[str], str]:
    weights = "model.safetensors" if safetensors else "pytorch_model.bin"
    index = weights + ".index.json"
    if count == 1:
        return [weights], index
    stem, ext = weights.rsplit(".", 1)
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.{ext}" for i in range(count)], index


def _write_safetensors_shard(
    reader: CheckpointReader, path: str, names: list[str], dtypes: dict[str, torch.dtype]
) -> None:
    meta = reader.metadata
    specs = [TensorSpec(n, dtypes[n], meta.tensors[n].shape) for n in names]
    writer = SafetensorsWriter(path, specs, {"format": "pt"})
    try:
        for name in names:
            store, state = _source(reader, name)
            for chunk in reader.stream(store, name, state):
                writer.write(chunk.to(dtypes[name]))
        writer.close()  # fsyncs
    except BaseException:
        writer.abort()
        raise


def _write_bin_shard(reader: CheckpointReader, path: str, names: list[str], dtypes: dict[str, torch.dtype]) -> None:
    shard = {}
    for name in names:
        store, state = _source(reader, name)
        shard[name] = reader.read_tensor(store, name, dtype=dtypes[name], state=state)
    with open(path, "wb") as f:
        torch.save(shard, f)
        f.flush()
        os.fsync(f.fileno())


def _temporary(out: str, file: str) -> str:
    return os.path.join(out, f".{file}.{os.getpid()}.tmp")


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """Write the consolidated weights to `output_dir` as Hugging Face shards; returns the files written.

    `model.safetensors`, or `model-00001-of-0000N.safetensors` plus `model.safetensors.index.json`
    (`pytorch_model*.bin` with `safe_serialization=False`). Tied aliases are written once, under the
    canonical name, as `save_pretrained` does. See [Note: streaming export] for the memory bound and
    [Note: export commit] for what a failure leaves.
    """
    out_dtype = output_dtype(dtype)
    out = os.fspath(output_dir)
    created = not os.path.isdir(out)
    temporaries: dict[str, str] = {}  # final name -> this call's temporary file
    try:
        with CheckpointReader(resolve_checkpoint(checkpoint_dir, tag)) as opened:
            reader = whole_reader(opened)
            meta = reader.metadata
            names = _exported_names(meta, exclude_frozen_parameters)
            dtypes = {n: _out_dtype(meta.tensors[n].dtype, out_dtype) for n in names}
            sizes = [(n, meta.tensors[n].numel * dtypes[n].itemsize) for n in names]
            shards = plan_shards(sizes, parse_size(max_shard_size))
            files, index_name = _shard_names(len(shards), safe_serialization)
            write = _write_safetensors_shard if safe_serialization else _write_bin_shard
            os.makedirs(out, exist_ok=True)
            for file, shard in zip(files, shards, strict=True):
                temporaries[file] = _temporary(out, file)
                write(reader, temporaries[file], shard, dtypes)
        if len(files) > 1:
            index = {
                "metadata": {"total_size": sum(size for _, size in sizes)},
                "weight_map": {n: f for f, shard in zip(files, shards, strict=True) for n in shard},
            }
            temporaries[index_name] = _temporary(out, index_name)
            write_file(temporaries[index_name], (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
    except BaseException:
        for path in temporaries.values():
            with contextlib.suppress(OSError):
                os.unlink(path)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    _commit(out, temporaries, index_name)
    return list(temporaries)


def _commit(out: str, temporaries: dict[str, str], index_name: str) -> None:
    """[Note: export commit]
    An export writes every file under a temporary name of its own and renames them only once all are written (the
    index last): a conversion that fails (a corrupted checkpoint, a full disk) removes its temporaries and nothing
    else, so an earlier export in the folder stays whole, and a reader never finds an index naming a shard that is
    not there yet. A crash during the renames leaves each file whole, old or new (a crash before them, hidden
    `.<file>.<pid>.tmp` files only). Then what is left of an earlier export of the same kind goes, as
    `save_pretrained` removes it: its shards that the new one does not have (`model-00003-of-00003.safetensors`
    beside a new export of two), and the single file or the index of the other form, which `from_pretrained` would
    read instead of (or mix with) the new files."""
    for file, tmp in temporaries.items():
        os.replace(tmp, os.path.join(out, file))
    weights = index_name.removesuffix(".index.json")
    stem, ext = weights.rsplit(".", 1)
    shard = re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.{re.escape(ext)}")
    for name in os.listdir(out):
        stale = name not in temporaries and (shard.fullmatch(name) or name in (weights, index_name))
        if stale and os.path.isfile(os.path.join(out, name)):
            os.unlink(os.path.join(out, name))
    fsync_dir(out)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's name and arguments).

    Example:
        >>> convert_zero_checkpoint_to_fp32_state_dict("ckpt", "hf_out", max_shard_size="2GB")  # doctest: +SKIP
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
    """
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir, output_dir, torch.float32, max_shard_size, safe_serialization, tag, exclude_frozen_parameters
    )


# -- command line ----------------------------------------------------------------------------------------------
def add_convert_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of `zeroshard convert CHECKPOINT OUT` (for the `zeroshard` command's sub-parser)."""
    parser.add_argument("checkpoint", help="save_dir of save_checkpoint (or one tagged checkpoint directory)")
    parser.add_argument("output", help="directory for the safetensors shards and index")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of floating tensors")
    parser.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB or 500MiB")
    parser.add_argument("--exclude-frozen", action="store_true", help="leave out frozen parameters")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one 'latest' names)")
    parser.add_argument("--format", choices=("safetensors", "bin"), default="safetensors")
    return parser


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Register `convert` on the `zeroshard` command's sub-parsers (the cli modules' `add_parser` shape)."""
    parser = sub.add_parser(
        "convert", parents=parents, help="consolidate a checkpoint into safetensors shards and an index"
    )
    add_convert_arguments(parser).set_defaults(run=run_convert)


def convert_main(argv: Sequence[str] | None = None) -> int:
    """`python -m zeroshard.checkpoint.export CHECKPOINT OUT ...`: returns the exit status (an error is one line on
    stderr, as `zeroshard convert` prints it)."""
    from zeroshard.cli.main import run_guarded

    parser = add_convert_arguments(argparse.ArgumentParser(prog="zeroshard convert", description=__doc__))
    return run_guarded(run_convert, parser.parse_args(argv), parser.prog)


def run_convert(args: argparse.Namespace) -> int:
    from zeroshard.cli.common import EXIT_CONFIG, CLIError

    if not os.path.isdir(args.checkpoint):  # a wrong path is bad input (exit 2), as a missing `train --resume`
        what = "is a file" if os.path.exists(args.checkpoint) else "does not exist"
        raise CLIError(f"{args.checkpoint}: {what}; name a checkpoint folder (a save_dir or a tag)", EXIT_CONFIG)
    from zeroshard.utils.files import probe_writable

    try:  # before any shard is read (a file there, a read-only folder: raw FileExistsError/OSError after the reading)
        probe_writable(args.output, ".zeroshard_convert_", keep=False)
    except OSError as err:
        raise CLIError(
            f"{args.output}: cannot write there ({err.strerror}); name a writable folder", EXIT_CONFIG
        ) from None
    files = convert_zero_checkpoint_to_state_dict(
        args.checkpoint,
        args.output,
        DTYPES[args.dtype],
        args.max_shard_size,
        args.format == "safetensors",
        args.tag,
        args.exclude_frozen,
    )
    sys.stdout.write("".join(os.path.join(args.output, f) + "\n" for f in files))
    return 0


if __name__ == "__main__":
    raise SystemExit(convert_main())
