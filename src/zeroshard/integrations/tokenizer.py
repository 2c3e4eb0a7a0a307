"""Tokenizers: a model folder's own, or a built-in byte-level default that needs no download.

The default is transformers' ByT5Tokenizer without extra ids: 256 byte ids shifted by 3 after
<pad>=0, </s>=1, <unk>=2 (259 ids). It is a real Hugging Face tokenizer, so the exported folder's
`AutoTokenizer.from_pretrained` works; bulk encoding takes a vectorised shortcut (byte + 3).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.errors import ConfigError

BYTE_OFFSET = 3  # ByT5: ids 0-2 are <pad>, </s>, <unk>
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def byte_tokenizer() -> Any:
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer(extra_ids=0)


def has_tokenizer(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def load_tokenizer(path: str | None) -> Any:
    """The tokenizer in `path`, or the byte-level default when `path` is None."""
    if path is None:
        return byte_tokenizer()
    if not os.path.isdir(path) or not has_tokenizer(path):
        raise ConfigError(f"tokenizer folder {path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def is_byte_tokenizer(tokenizer: Any) -> bool:
    return type(tokenizer).__name__ == "ByT5Tokenizer"


def encode_documents(tokenizer: Any, documents: Iterable[str], batch: int = 256) -> torch.Tensor:
    """One stream of token ids: every document followed by the end-of-sequence token."""
    eos = tokenizer.eos_token_id
    pieces: list[torch.Tensor] = []
    if is_byte_tokenizer(tokenizer):
        for doc in documents:
            data = bytearray(doc.encode("utf-8"))
            ids = (
                torch.frombuffer(data, dtype=torch.uint8).long() + BYTE_OFFSET
                if data
                else torch.empty(0, dtype=torch.long)
            )
            pieces += [ids, torch.tensor([eos])]
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
    docs = list(documents)
    for start in range(0, len(docs), batch):
        encoded = tokenizer(docs[start : start + batch], add_special_tokens=False)["input_ids"]
        for ids in encoded:
            pieces.append(torch.tensor(ids + ([eos] if eos is not None else []), dtype=torch.long))
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
