"""Streaming safetensors files: written tensor by tensor, read into the caller's buffers, CRC-checked.

[Note: why our own safetensors code]
The format is small: an 8-byte little-endian header length, a JSON header mapping each tensor name to
`{dtype, shape, data_offsets}` (plus a `__metadata__` map of strings), then the raw little-endian bytes.
The `safetensors` library writes a file from a dict of tensors held in memory and reads by mmap. A
checkpoint wants two things it does not offer: write a tensor's bytes as they are produced (export
assembles an output tensor from many pieces, so peak memory stays at one chunk) and land bytes straight
in a destination view (a slice of a flat master shard) while checking a CRC32 per tensor. The CRCs live
in `__metadata__` under `crc32:<name>`; the header is written first with placeholders and rewritten on
close, so its length never changes. Files written here open with `safetensors.safe_open` and files it
writes are read here (without CRCs); `tests/unit/test_checkpoint_format.py` checks both directions.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from zeroshard.checkpoint.errors import CheckpointError

CHUNK_BYTES = 16 * 1024 * 1024  # read/convert granularity: bounds the memory of partial and converted reads
_CRC_PREFIX = "crc32:"
_CRC_PLACEHOLDER = "00000000"

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the JSON spelling in checkpoint metadata)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor of a file, known before its bytes are written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous CPU tensor's storage (any dtype, including bf16 and 0-d)."""
    return t.reshape(-1).view(torch.uint8)


def _buffer(data: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, without a copy. Through a DLPack alias: `.numpy()` marks the
    storage it is called on non-resizable for good, and NVMe offload resizes the storages it saves."""
    return memoryview(cast(bytes, torch.from_dlpack(data).numpy()))


def _header_bytes(specs: Sequence[TensorSpec], metadata: Mapping[str, str], crcs: Mapping[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": {**metadata, **{_CRC_PREFIX + n: c for n, c in crcs.items()}}}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": DTYPE_CODES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors pads the header with spaces to 8-byte alignment


class SafetensorsWriter:
    """Write the tensors of `specs`, in that order, possibly in several chunks each; `close()` commits.

    Example:
        >>> import tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> w = SafetensorsWriter(path, [TensorSpec("a", torch.float32, (2, 3))])
        >>> w.write(torch.zeros(4)); w.write(torch.ones(2)); size = w.close()
        >>> SafetensorsReader(path).read("a").tolist()
        [[0.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
    """

    def __init__(
        self, path: str | os.PathLike[str], specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
    ):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"{path}: duplicate tensor names")
        self.path = os.fspath(path)
        self._specs = list(specs)
        self._metadata = dict(metadata or {})
        self._crcs = {s.name: _CRC_PLACEHOLDER for s in specs}
        self._file: io.BufferedWriter = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        header = _header_bytes(self._specs, self._metadata, self._crcs)
        self._file.write(struct.pack("<Q", len(header)) + header)
        self._index = 0
        self._written = 0  # bytes of the current tensor
        self._crc = 0

    @property
    def current(self) -> TensorSpec | None:
        return self._specs[self._index] if self._index < len(self._specs) else None

    def write(self, chunk: torch.Tensor) -> None:
        """Append `chunk` (the next elements of the current tensor, in its dtype) to the file."""
        if chunk.numel() == 0:  # (an empty tensor's spec is finished by _advance_empty; its chunk has no bytes)
            return
        self._advance_empty()
        spec = self.current
        if spec is None:
            raise ValueError(f"{self.path}: every tensor is already written")
        if chunk.dtype != spec.dtype:
            raise ValueError(f"{self.path}: {spec.name} is {spec.dtype}, got a {chunk.dtype} chunk")
        data = _byte_view(chunk.detach().to("cpu").contiguous())
        if self._written + data.numel() > spec.nbytes:
            raise ValueError(f"{self.path}: {spec.name} holds {spec.nbytes} bytes; the chunks exceed that")
        buffer = _buffer(data)
        self._file.write(buffer)
        self._crc = zlib.crc32(buffer, self._crc)
        self._written += data.numel()
        if self._written == spec.nbytes:
            self._finish_tensor()

    def add(self, tensor: torch.Tensor) -> None:
        """Write the current tensor whole."""
        self.write(tensor)
        self._advance_empty()

    def _advance_empty(self) -> None:
        while self.current is not None and self.current.nbytes == 0:
            self._finish_tensor()

    def _finish_tensor(self) -> None:
        spec = self._specs[self._index]
        self._crcs[spec.name] = f"{self._crc:08x}"
        self._index += 1
        self._written = 0
        self._crc = 0

    def close(self) -> int:
        """Rewrite the header with the CRCs, flush and fsync; returns the file size."""
        self._advance_empty()
        if self.current is not None:
            self._file.close()
            raise ValueError(f"{self.path}: {self.current.name} and later tensors were never written")
        header = _header_bytes(self._specs, self._metadata, self._crcs)
        self._file.seek(8)
        self._file.write(header)
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.seek(0, os.SEEK_END)
        self._file.close()
        return size

    def abort(self) -> None:
        self._file.close()

    def header_crc32(self) -> str:
        header = _header_bytes(self._specs, self._metadata, self._crcs)
        return f"{zlib.crc32(header):08x}"


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes lie in a file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int
    crc32: str | None

    @property
    def numel(self) -> int:
        return (self.end - self.begin) // self.dtype.itemsize


class SafetensorsReader:
    """Read tensors (whole or an element range) of one file, checking sizes and CRCs.

    Every problem is a `CheckpointError` that names the file: truncated, not safetensors, a CRC that
    does not match, a tensor that is not there.
    """

    def __init__(
        self, path: str | os.PathLike[str], expected_size: int | None = None, expected_header_crc32: str | None = None
    ):
        self.path = os.fspath(path)
        try:
            self._file: io.BufferedReader = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: checkpoint file is missing") from None
        size = os.fstat(self._file.fileno()).st_size
        if expected_size is not None and size != expected_size:
            self._file.close()
            raise CheckpointError(
                f"{self.path}: file is {size} bytes but the checkpoint metadata says {expected_size}; "
                "it is truncated or was modified after the save"
            )
        self.entries, self.metadata = self._parse_header(size, expected_header_crc32)

    def _parse_header(self, size: int, expected_crc: str | None) -> tuple[dict[str, Entry], dict[str, str]]:
        prefix = self._file.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{self.path}: file is truncated ({size} bytes, no safetensors header)")
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8:
            raise CheckpointError(f"{self.path}: header length {length} exceeds the file size {size}; truncated")
        raw = self._file.read(length)
        if expected_crc is not None and f"{zlib.crc32(raw):08x}" != expected_crc:
            raise CheckpointError(f"{self.path}: header checksum mismatch; the file is corrupted")
        try:
            header = json.loads(raw)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: header is not valid JSON ({e}); the file is corrupted") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is a JSON {type(header).__name__}, not an object; corrupted")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{self.path}: header's __metadata__ is not an object; the file is corrupted")
        base = 8 + length
        entries = {name: self._entry(name, info, base, size, metadata) for name, info in header.items()}
        self._check_layout(entries, base, size)
        return entries, metadata

    def _entry(self, name: str, info: Any, base: int, size: int, metadata: Mapping[str, str]) -> Entry:
        """One header entry, checked as the safetensors library checks it: a known dtype, a shape, offsets within
        the file that hold exactly the shape's bytes (a shape and offsets that disagree were read out of range)."""
        try:
            code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            ints = [*shape, begin, end]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
                raise TypeError
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(
                f"{self.path}: header entry of tensor {name!r} is not {{dtype, shape, data_offsets}} of non-negative "
                "integers; the file is corrupted"
            ) from None
        if code not in CODE_DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
        entry = Entry(name, CODE_DTYPES[code], shape, base + begin, base + end, metadata.get(_CRC_PREFIX + name))
        if entry.end > size:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} ends at byte {entry.end} but the file has {size}; truncated"
            )
        if end - begin != math.prod(shape) * entry.dtype.itemsize:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} of shape {list(shape)} ({code}) needs "
                f"{math.prod(shape) * entry.dtype.itemsize} bytes, but its data_offsets [{begin}, {end}) hold "
                f"{end - begin}; the file is corrupted"
            )
        return entry

    def _check_layout(self, entries: Mapping[str, Entry], base: int, size: int) -> None:
        """The tensors' bytes tile the data buffer, each after the last, as the safetensors format requires: offsets
        that overlap, leave holes or point into the header load another tensor's bytes (or the header's) unnoticed."""
        at = 0
        for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
            start = entry.begin - base
            if start != at:
                raise CheckpointError(
                    f"{self.path}: tensor {entry.name!r} starts at data byte {start}, where the previous tensor ends "
                    f"at {at} (overlapping or misplaced data_offsets); the file is corrupted"
                )
            at = start + (entry.end - entry.begin)
        if at != size - base:
            raise CheckpointError(
                f"{self.path}: the tensors hold {at} bytes but the file has {size - base} after its header (bytes no "
                "tensor indexes); the file is corrupted"
            )

    def entry(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name!r} is not in this file") from None

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, in its stored dtype and shape."""
        entry = self.entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_range(name, 0, entry.numel, out.reshape(-1))
        return out

    def read_range(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Elements [start, stop) of the flattened tensor into `out` (1-D, any dtype, any device).

        A tensor with a CRC is streamed whole so that its CRC is always checked; one without (files other
        libraries wrote) is read only in [start, stop). Memory beyond `out` is one chunk of CHUNK_BYTES.
        """
        entry = self.entry(name)
        if not 0 <= start <= stop <= entry.numel or out.numel() != stop - start:
            raise ValueError(f"{self.path}: bad range [{start}, {stop}) of {name} ({entry.numel} elements)")
        if entry.crc32 is None:
            self._read_slice(entry, start, stop, out)
            return
        whole = start == 0 and stop == entry.numel
        if whole and out.dtype == entry.dtype and out.device.type == "cpu" and out.is_contiguous():
            data = _byte_view(out)
            self._readinto(entry.begin, data)
            self._check_crc(entry, zlib.crc32(_buffer(data)))
            return
        crc = 0
        for first, chunk in self._chunks(entry):
            crc = zlib.crc32(_buffer(chunk), crc)
            values = chunk.view(entry.dtype)
            lo, hi = max(start, first), min(stop, first + values.numel())
            if lo < hi:
                out[lo - start : hi - start].copy_(values[lo - first : hi - first])
        self._check_crc(entry, crc)

    def _read_slice(self, entry: Entry, start: int, stop: int, out: torch.Tensor) -> None:
        """Only the bytes of [start, stop), with positional reads: threads may share this reader."""
        item = entry.dtype.itemsize
        if out.dtype == entry.dtype and out.device.type == "cpu" and out.is_contiguous():
            self._pread(entry.begin + start * item, _byte_view(out))
            return
        step = max(1, CHUNK_BYTES // item)
        buffer = torch.empty(min(step, stop - start), dtype=entry.dtype)
        for first in range(start, stop, step):
            n = min(step, stop - first)
            chunk = buffer[:n]
            self._pread(entry.begin + first * item, _byte_view(chunk))
            out[first - start : first - start + n].copy_(chunk)

    def _pread(self, offset: int, data: torch.Tensor) -> None:
        view = _buffer(data)
        got = 0
        while got < len(view):
            n = os.preadv(self._file.fileno(), [view[got:]], offset + got)
            if not n:
                raise CheckpointError(f"{self.path}: unexpected end of file at byte {offset + got}; truncated")
            got += n

    def stream(self, name: str) -> Iterator[torch.Tensor]:
        """The tensor's elements in chunks (stored dtype, reused buffer: copy before the next chunk);
        the CRC is checked after the last chunk."""
        entry = self.entry(name)
        crc = 0
        for _, chunk in self._chunks(entry):
            crc = zlib.crc32(_buffer(chunk), crc)
            yield chunk.view(entry.dtype)
        self._check_crc(entry, crc)

    def _chunks(self, entry: Entry) -> Iterator[tuple[int, torch.Tensor]]:
        item = entry.dtype.itemsize
        step = max(item, CHUNK_BYTES // item * item)
        buffer = torch.empty(min(step, entry.end - entry.begin), dtype=torch.uint8)
        position = entry.begin
        while position < entry.end:
            n = min(step, entry.end - position)
            chunk = buffer[:n]
            self._readinto(position, chunk)
            yield (position - entry.begin) // item, chunk
            position += n

    def _readinto(self, offset: int, data: torch.Tensor) -> None:
        # positional: the streaming loader's threads share this reader (a seek then a read let one read the other's
        # bytes, which the CRC then refused)
        self._pread(offset, data)

    def _check_crc(self, entry: Entry, crc: int) -> None:
        if entry.crc32 is not None and f"{crc:08x}" != entry.crc32:
            raise CheckpointError(
                f"{self.path}: checksum mismatch in tensor {entry.name!r} (stored {entry.crc32}, read {crc:08x}); "
                "the file is corrupted"
            )

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
