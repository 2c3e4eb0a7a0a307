"""Training text: a local text or JSONL file, a folder of them, or the bundled corpus (no download).

Documents are tokenized into one stream (each followed by end-of-sequence), cut into blocks of
`seq_len` tokens, and the last blocks are held out for evaluation. Every rank reads the same bytes in
the same order, so the split and the blocks agree across ranks without communication.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from zeroshard.errors import ZeroshardError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl", ".json")


class DataError(ZeroshardError):
    """The dataset is missing, unreadable or too small; the message names the file."""


@dataclass(frozen=True)
class DataSpec:
    path: str | None  # None: the bundled corpus (the Python standard library's sources)
    text_field: str = "text"
    max_bytes: int | None = None  # read at most this much text (the bundled corpus defaults to 2 MB)


def check_readable(spec: DataSpec) -> None:
    """Fail fast (before starting processes) on a missing or unreadable dataset path."""
    if spec.path is None:
        return
    if not os.path.exists(spec.path):
        raise DataError(
            f"dataset {spec.path} does not exist; pass a text/JSONL file or a folder of them, "
            "or leave out --data for the bundled corpus"
        )
    files = list(_files(spec.path))
    if not files:
        raise DataError(f"dataset folder {spec.path} has no text files ({', '.join(TEXT_SUFFIXES)})")
    for name in files[:1]:
        if not os.access(name, os.R_OK):
            raise DataError(f"dataset file {name} is not readable (permissions)")


CONTENT_CHECK_CHARS = 1 << 30  # what the launcher reads of a dataset before starting the ranks


def check_contents(spec: DataSpec) -> None:
    """Read the text the ranks will read (up to CONTENT_CHECK_CHARS characters), so that a file that is not UTF-8, a
    JSONL line that is not JSON or lacks the text field, fail once before any process starts; not each rank after
    its start."""
    if spec.path is None:
        return
    limit = min(spec.max_bytes or CONTENT_CHECK_CHARS, CONTENT_CHECK_CHARS)
    for _ in read_documents(DataSpec(spec.path, spec.text_field, limit)):
        pass


def read_documents(spec: DataSpec) -> Iterator[str]:
    """The documents of the dataset, in a fixed order, up to `spec.max_bytes` of text."""
    if spec.path is None:
        from zeroshard.data import stdlib_corpus

        yield stdlib_corpus(spec.max_bytes or 2_000_000).decode("utf-8", errors="replace")
        return
    budget = spec.max_bytes
    for name in _files(spec.path):
        for doc in _read_file(name, spec.text_field, budget):
            if budget is not None:
                doc = doc[:budget]
                budget -= len(doc)
            yield doc
            if budget is not None and budget <= 0:
                return


def _files(path: str) -> Iterator[str]:
    if os.path.isfile(path):
        yield path
        return
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(TEXT_SUFFIXES):
                yield os.path.join(dirpath, name)


def _read_file(name: str, text_field: str, limit: int | None = None) -> Iterator[str]:
    """The documents of one file; a text file as one document of at most `limit` characters (None: all of it)."""
    try:
        with open(name, encoding="utf-8") as handle:
            if not name.endswith((".jsonl", ".json")):
                yield handle.read(-1 if limit is None else limit)
                return
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield _json_text(line, name, number, text_field)
    except UnicodeDecodeError as err:
        raise DataError(f"dataset file {name} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise DataError(f"dataset file {name} cannot be read: {err.strerror or err}") from None


def _json_text(line: str, name: str, number: int, text_field: str) -> str:
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"dataset file {name} line {number}: not JSON ({err.msg})") from None
    if isinstance(record, str):
        return record
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise DataError(
            f"dataset file {name} line {number}: no string field {text_field!r} (choose one with --text-field)"
        )
    return str(record[text_field])


class TokenBlocks(Dataset[torch.Tensor]):
    """Fixed-length blocks of a token stream; the model shifts labels itself (labels = input_ids)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.blocks = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.blocks[index]


def split_blocks(tokens: torch.Tensor, seq_len: int, eval_fraction: float) -> tuple[TokenBlocks, TokenBlocks]:
    """(train, eval): the last `eval_fraction` of the blocks (at least one) are held out."""
    blocks = len(tokens) // seq_len
    if blocks < 2:
        raise DataError(
            f"the dataset has {len(tokens)} tokens: fewer than 2 blocks of --seq-len {seq_len}; "
            "use more text or a shorter --seq-len"
        )
    held = max(1, round(blocks * eval_fraction)) if eval_fraction > 0 else 0
    cut = (blocks - held) * seq_len
    return TokenBlocks(tokens[:cut], seq_len), TokenBlocks(tokens[cut : blocks * seq_len], seq_len)
