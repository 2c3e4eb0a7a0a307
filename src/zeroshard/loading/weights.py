"""Weights read from a safetensors checkpoint straight into the memory that keeps them.

[Note: streaming load]
A sharded rank keeps a contiguous range of each section of a unit's flat buffer, and a parameter lies in one section;
a safetensors file stores each tensor's elements contiguously, row-major: the part of a parameter a rank keeps is
one byte range of one file. So each
rank reads exactly its ranges with positional reads (no mmap: touched mapped pages would count in the
process's resident memory for as long as the file stays mapped) into its shard, converting the stored dtype
in chunks. No rank materialises a full parameter it does not keep, and the bytes of the checkpoint are read
once over all ranks. Stages 0-2 keep every parameter, so there each rank reads the whole checkpoint into its
parameters.

[Note: weights of a meta model]
`zero_init()` builds the model on the meta device; which checkpoint its weights come from must reach
`initialize`, which the user calls with the model alone (as with DeepSpeed's `zero.Init`). The model is the key
of a weak map here (`attach` / `weights_for`): nothing is added to the user's module or its parameters, and
the entry goes away with the model.
"""

from __future__ import annotations

import json
import math
import os
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.safetensors_io import Entry, SafetensorsReader
from zeroshard.loading.convert import Conversions, plan_conversions

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
READ_THREADS = 4  # positional reads release the GIL: pieces of one unit (often in different files) overlap


class SafetensorsFolder:
    """The tensors of a Hugging Face checkpoint folder: `model.safetensors`, or the shards that
    `model.safetensors.index.json` lists. Any problem is a `CheckpointError` naming the file."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.folder = os.fspath(folder)
        index = os.path.join(self.folder, INDEX_FILE)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map: Mapping[str, str] = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e!r}); it needs a 'weight_map'") from None
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(self.folder, SINGLE_FILE)):
            weight_map, files = {}, [SINGLE_FILE]
        else:
            raise CheckpointError(
                f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE}; streaming load reads safetensors checkpoints "
                "(save the model with save_pretrained(..., safe_serialization=True))"
            )
        self.readers: list[SafetensorsReader] = []
        self.entries: dict[str, tuple[SafetensorsReader, Entry]] = {}
        try:
            for name in files:
                reader = SafetensorsReader(os.path.join(self.folder, name))
                self.readers.append(reader)
                for key, entry in reader.entries.items():
                    self.entries[key] = (reader, entry)
        except BaseException:
            self.close()
            raise
        for key, name in weight_map.items():
            if key not in self.entries:
                raise CheckpointError(f"{index}: lists {key!r} in {name}, but that file does not hold it")

        # the model's names of converted tensors ([Note: converted checkpoints in a streaming load])
        self.conversions = Conversions()

    def convert_for(self, model: nn.Module) -> Conversions:
        """Rename and fuse as transformers would for `model`: `names()` and `read` then speak the model's keys."""
        self.conversions = plan_conversions(model, {k: e.shape for k, (_, e) in self.entries.items()})
        return self.conversions

    def entry(self, key: str) -> Entry:
        """A stored tensor's record (its stored name)."""
        return self.entries[key][1]

    def names(self) -> dict[str, tuple[int, ...]]:
        """Each key a model can ask for, with its shape: the stored ones no conversion took, and the converted."""
        consumed = self.conversions.consumed
        out = {k: e.shape for k, (_, e) in self.entries.items() if k not in consumed}
        out.update({k: self.entries[source][1].shape for k, source in self.conversions.renamed.items()})
        out.update({k: c.shape for k, c in self.conversions.composites.items()})
        return out

    def stored(self, key: str) -> list[str]:
        """The stored tensors behind a model-facing key."""
        composite = self.conversions.composites.get(key)
        return composite.sources if composite is not None else [self.conversions.renamed.get(key, key)]

    def read(self, key: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements [start, stop) of the flattened tensor `key` into `out`, cast to out's dtype."""
        composite = self.conversions.composites.get(key)
        if composite is None:
            source = self.conversions.renamed.get(key, key)
            self.entries[source][0].read_range(source, start, stop, out)
            return
        for source, lo, hi, at in composite.pieces(start, stop):
            self.entries[source][0].read_range(source, lo, hi, out[at : at + hi - lo])

    @property
    def nbytes(self) -> int:
        return sum(e.end - e.begin for _, e in self.entries.values())

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.readers = []


@dataclass(frozen=True)
class LoadReport:
    """What a load did not match, in transformers' terms (`output_loading_info`)."""

    missing_keys: tuple[str, ...]  # the model's, left to their initialisation
    unexpected_keys: tuple[str, ...]  # the checkpoint's, unused
    mismatched_keys: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]  # (key, checkpoint, model shape)

    def as_dict(self) -> dict[str, list[object]]:
        return {
            "missing_keys": list(self.missing_keys),
            "unexpected_keys": list(self.unexpected_keys),
            "mismatched_keys": list(self.mismatched_keys),
            "error_msgs": [],
        }


class StreamedWeights:
    """Which checkpoint tensor gives each parameter and buffer of a model, and the reads that fill them. Tensors
    are known by identity, not by name: a wrapper (PEFT's `base_layer`) renames them, tied weights have several
    names, and turning a meta parameter real keeps its Python object (`make_real`)."""

    def __init__(
        self, folder: SafetensorsFolder, keys: Mapping[int, str], tensors: Iterable[torch.Tensor], report: LoadReport
    ):
        self.folder = folder
        self._keys = dict(keys)  # id(tensor) -> checkpoint key
        self._tensors = list(tensors)  # the ids stay theirs while the weights are attached
        self.report = report
        self._shapes: dict[str, tuple[int, ...]] | None = None  # each key's stored shape, read once
        # tensors that hold some rows of their checkpoint tensor (AutoEP's experts): element offset, rows kept
        self._rows: dict[int, tuple[int, int]] = {}
        self.elements_read: dict[str, int] = {}  # per checkpoint key, by this process: what streaming saved shows
        self._counting = threading.Lock()

    def covers(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._keys

    def alias(self, tensor: torch.Tensor, same_as: torch.Tensor) -> None:
        """`tensor` (a copy of `same_as` made on the meta device) is read from `same_as`'s checkpoint tensor."""
        self._keys[id(tensor)] = self._keys[id(same_as)]
        self._tensors.append(tensor)

    def read(self, tensor: torch.Tensor, start: int, stop: int, out: torch.Tensor) -> None:
        offset = self._rows.get(id(tensor), (0, 0))[0]
        self.folder.read(self._keys[id(tensor)], start + offset, stop + offset, out)
        with self._counting:  # (reads run on a thread pool)
            self.elements_read[self._keys[id(tensor)]] = (
                self.elements_read.get(self._keys[id(tensor)], 0) + stop - start
            )

    def keep_rows(self, tensor: torch.Tensor, first: int, count: int) -> None:
        """`tensor` (on the meta device, about to become rows `first .. first + count - 1` of its checkpoint tensor:
        AutoEP's split experts, [Note: AutoEP] in moe/auto.py) reads those rows from now on."""
        per_row = math.prod(tensor.shape[1:])
        self._rows[id(tensor)] = (first * per_row, count)

    def refuse_resized(self, model: nn.Module) -> None:
        """A meta tensor this checkpoint gives values to must still have the checkpoint's shape: one resized after
        `zero_init` built it (`resize_token_embeddings` on the meta device, which transformers' mean resizing refuses
        and `mean_resizing=False` lets through) has no rows to read for its new shape. Refused in one line, with the
        way that works (DeepSpeed's: transformers gathers the embeddings around the resize under ZeRO-3)."""
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
            if t.is_meta and self.covers(t):
                self._refuse_resized(t, name)

    def _refuse_resized(self, t: torch.Tensor, name: str) -> None:
        if self._shapes is None:
            self._shapes = self.folder.names()
        shapes, key = self._shapes, self._keys[id(t)]
        stored = tuple(shapes[key])
        if id(t) in self._rows:  # some rows of it
            stored = (self._rows[id(t)][1], *stored[1:])
        if tuple(t.shape) != stored:
            raise CheckpointError(
                f"{name} is {list(t.shape)} but {key} in {self.folder.folder} is {list(shapes[key])}: the model was "
                "resized after zero_init built it from the checkpoint; resize inside `with zeroshard."
                "GatheredParameters([model.get_input_embeddings().weight, model.get_output_embeddings().weight], "
                "modifier_rank=0):` (what transformers does under DeepSpeed's ZeRO-3)"
            )

    def read_whole(self, items: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """For each (model tensor, contiguous real destination): the destination filled from the checkpoint,
        in parallel."""
        items = list(items)
        for t, _ in items:
            self._refuse_resized(t, self._keys[id(t)])
        self._run([(t, 0, out.numel(), out.detach().view(-1)) for t, out in items])

    def read_flat(self, slots: Sequence[tuple[torch.Tensor, int, int]], out: torch.Tensor, lo: int, hi: int) -> None:
        """Elements [lo, hi) of a flat buffer laid out as `slots` (tensor, offset, numel) into `out` (hi - lo long):
        each tensor's part of the range is read from the file, padding is left as it is."""
        jobs = []
        for tensor, offset, numel in slots:
            begin, end = max(lo, offset), min(hi, offset + numel)
            if begin < end:
                jobs.append((tensor, begin - offset, end - offset, out[begin - lo : end - lo]))
        self._run(jobs)

    def _run(self, jobs: Sequence[tuple[torch.Tensor, int, int, torch.Tensor]]) -> None:
        if len(jobs) <= 1:
            for tensor, start, stop, out in jobs:
                self.read(tensor, start, stop, out)
            return
        with ThreadPoolExecutor(min(READ_THREADS, len(jobs)), thread_name_prefix="zeroshard-load") as pool:
            for future in [pool.submit(self.read, *job) for job in jobs]:
                future.result()

    def close(self) -> None:
        self.folder.close()
        self._tensors = []


_ATTACHED: weakref.WeakKeyDictionary[nn.Module, StreamedWeights] = weakref.WeakKeyDictionary()


def attach(model: nn.Module, weights: StreamedWeights) -> None:
    """[Note: weights of a meta model] remember where `model`'s weights are until `initialize` reads them."""
    _ATTACHED[model] = weights


def weights_for(root: nn.Module) -> StreamedWeights | None:
    """The checkpoint a meta model (the module that wraps it, or one of its submodules: `full.model`) was built from
    by `zero_init`."""
    for module in root.modules():
        weights = _ATTACHED.get(module)
        if weights is not None:
            return weights
    # a submodule of what from_pretrained returned, or a module holding one: found by the tensors it gives values
    # to (its parameters were replayed from their random initialisation, silently)
    return next((w for p in root.parameters() if p.is_meta and (w := weights_covering(p)) is not None), None)


def weights_covering(tensor: torch.Tensor) -> StreamedWeights | None:
    """The attached checkpoint that gives `tensor` its values, if any."""
    return next((w for w in list(_ATTACHED.values()) if w.covers(tensor)), None)


def release(root: nn.Module) -> None:
    """The files are closed and forgotten once every parameter is loaded."""
    for module in root.modules():
        weights = _ATTACHED.pop(module, None)
        if weights is not None:
            weights.close()
