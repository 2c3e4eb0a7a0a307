"""Read any element range of any tensor of a checkpoint, whatever layout wrote it.

[Note: resharding at load]
A checkpoint is a set of pieces (elements [begin, end) of a flattened tensor, see [Note: checkpoint
format]). To load, each rank lists the ranges it needs under its *current* layout (stage 0: whole
tensors; stages 1/2: its slices of every bucket, which depend on the world size and bucket size; stage 3:
its partition of each parameter) and asks `CheckpointReader.read_range` for each. The reader copies from
every stored piece that overlaps the range, converting dtypes where they differ. No offline conversion
step exists because none is needed: a world size or stage change is just a different set of ranges.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from zeroshard.checkpoint.atomic import read_checked
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import CheckpointMetadata, PieceRef, piece_key, read_metadata
from zeroshard.checkpoint.safetensors_io import SafetensorsReader, dtype_from_name

MODEL = "model"
OPTIM = "optim"


class CheckpointReader:
    """Open one checkpoint directory (`<save_dir>/<tag>`); files are opened lazily and checked once.

    Example:
        >>> reader = CheckpointReader("ckpt/global_step10")  # doctest: +SKIP
        >>> reader.read_tensor(MODEL, "wte.weight").shape  # doctest: +SKIP
        torch.Size([64, 32])
    """

    def __init__(self, tag_dir: str, metadata: CheckpointMetadata | None = None):
        self.tag_dir = tag_dir
        self.metadata = metadata if metadata is not None else read_metadata(tag_dir)
        self._files: dict[str, SafetensorsReader] = {}
        # a read has begun to fill a caller's tensor: once a file opened, its bytes go straight into `out`
        # ([Note: a torn load])
        self.delivered = False
        self._at_hand: dict[tuple[str, str], PieceRef | None] = {}  # has_state's piece of each tensor
        self._pieces = {
            MODEL: _sorted_checked(self.metadata.model_pieces, "model", self.metadata),
            OPTIM: _sorted_checked(self.metadata.optim_pieces, "optimizer", self.metadata),
        }

    def has(self, store: str, name: str) -> bool:
        return name in self._pieces[store]

    def has_state(self, store: str, name: str, state: str) -> bool | None:
        """Whether `name`'s pieces hold optimizer state `state` (Muon's matrices keep a momentum, the Adam half its
        moments: the keys differ by group); None when none of its files is at hand (a node-local checkpoint's other
        nodes). Asked of one piece: a save writes every key of a parameter's state with each of its pieces."""
        key = (store, name)
        if key not in self._at_hand:
            pieces = self._pieces[store].get(name, [])
            self._at_hand[key] = next((p for p in pieces if os.path.exists(os.path.join(self.tag_dir, p.file))), None)
        piece = self._at_hand[key]
        if piece is None:
            return None
        return piece_key(name, piece.begin, piece.end, state) in self._file(piece.file).entries

    def _file(self, rel: str) -> SafetensorsReader:
        reader = self._files.get(rel)
        if reader is None:
            record = self.metadata.files.get(rel)
            if record is None:
                raise CheckpointError(f"{os.path.join(self.tag_dir, rel)}: not listed in the checkpoint metadata")
            reader = SafetensorsReader(os.path.join(self.tag_dir, rel), record["bytes"], record.get("header_crc32"))
            self._files[rel] = reader
        return reader

    def read_range(
        self, store: str, name: str, begin: int, end: int, out: torch.Tensor, state: str | None = None
    ) -> None:
        """Elements [begin, end) of flattened `name` into the 1-D `out`, from every overlapping piece."""
        if begin == end:  # nothing to read (a parameter of no elements is saved without pieces)
            return
        pieces = self._pieces[store].get(name)
        if pieces is None:
            raise CheckpointError(f"{self.tag_dir}: the checkpoint has no {store} data for {name!r}")
        covered = 0
        for piece in pieces:
            lo, hi = max(begin, piece.begin), min(end, piece.end)
            if lo < hi:
                key = piece_key(name, piece.begin, piece.end, state)
                file = self._file(piece.file)
                self.delivered = True
                file.read_range(key, lo - piece.begin, hi - piece.begin, out[lo - begin : hi - begin])
                covered += hi - lo
        if covered != end - begin:
            raise CheckpointError(
                f"{self.tag_dir}: elements [{begin}, {end}) of {name!r} are not all in the checkpoint's pieces"
            )

    def read_tensor(
        self, store: str, name: str, dtype: torch.dtype | None = None, state: str | None = None
    ) -> torch.Tensor:
        """The whole tensor `name` in its stored shape (and `dtype`, default: as stored)."""
        info = self.metadata.tensors[name]
        out = torch.empty(info.numel, dtype=dtype or self.stored_dtype(store, name, state))
        self.read_range(store, name, 0, info.numel, out, state)
        return out.view(info.shape)

    def stored_dtype(self, store: str, name: str, state: str | None = None) -> torch.dtype:
        pieces = self._pieces[store].get(name)
        if not pieces and self.metadata.tensors[name].numel == 0:  # (saved without pieces: nothing to store)
            return dtype_from_name(self.metadata.tensors[name].dtype)
        if not pieces:
            raise CheckpointError(f"{self.tag_dir}: the checkpoint has no {store} data for {name!r}")
        # a file at hand first: a node-local checkpoint's other pieces are on other nodes ([Note: node-local ..])
        piece = next((p for p in pieces if os.path.exists(os.path.join(self.tag_dir, p.file))), pieces[0])
        return self._file(piece.file).entry(piece_key(name, piece.begin, piece.end, state)).dtype

    def stream(self, store: str, name: str, state: str | None = None) -> Iterator[torch.Tensor]:
        """The elements of `name` in order, in chunks (reused buffers: consume each before the next)."""
        if self.metadata.tensors[name].numel == 0 and name not in self._pieces[store]:
            return  # (a tensor of no elements is saved without pieces)
        for piece in self._pieces[store][name]:
            yield from self._file(piece.file).stream(piece_key(name, piece.begin, piece.end, state))

    def read_small(self, rel: str) -> bytes:
        """A whole non-tensor file (JSON, engine state), checked against its size and CRC."""
        return read_checked(os.path.join(self.tag_dir, rel), self.metadata.files.get(rel))

    def close(self) -> None:
        for reader in self._files.values():
            reader.close()
        self._files.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sorted_checked(
    pieces: dict[str, list[PieceRef]], what: str, meta: CheckpointMetadata
) -> dict[str, list[PieceRef]]:
    """Pieces by name, sorted by `begin`; overlapping pieces, or pieces beyond the tensor's elements, mean the
    metadata is wrong."""
    result: dict[str, list[PieceRef]] = {}
    for name, refs in pieces.items():
        ordered = sorted(refs, key=lambda p: p.begin)
        info = meta.tensors.get(name)
        if info is not None and ordered and (ordered[0].begin < 0 or ordered[-1].end > info.numel):
            raise CheckpointError(
                f"{what} pieces of {name!r} reach elements [{ordered[0].begin}, {ordered[-1].end}) of a tensor of "
                f"{info.numel}; the metadata is corrupted"
            )
        for a, b in zip(ordered, ordered[1:], strict=False):
            if b.begin < a.end:
                raise CheckpointError(f"{what} pieces of {name!r} overlap ({a} and {b}); the metadata is corrupted")
        result[name] = ordered
    return result
