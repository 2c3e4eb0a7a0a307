"""The one greedy chunker: consecutive items cut into chunks of about `limit` (buckets, sub-groups, shards)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal


def greedy_chunks(
    sizes: Sequence[int], limit: int, close: Literal["before", "after"], oversize_alone: bool = False
) -> list[list[int]]:
    """Indices of `sizes` in consecutive chunks. `close="before"`: a chunk is closed before the item that would
    take it past `limit` (Megatron's buckets; a chunk never passes the limit unless one item does).
    `close="after"`: a chunk is closed once it reaches `limit` (DeepSpeed's sub-groups). `oversize_alone`: an
    item larger than `limit` gets a chunk of its own and the open chunk goes on filling (Hugging Face's shards).

    >>> greedy_chunks([3, 3, 3], 5, "before"), greedy_chunks([3, 3, 3], 5, "after")
    ([[0], [1], [2]], [[0, 1], [2]])
    >>> greedy_chunks([2, 9, 2], 5, "before", oversize_alone=True)
    [[1], [0, 2]]
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        if oversize_alone and size > limit:
            chunks.append([i])
            continue
        if current and (filled + size > limit if close == "before" else filled >= limit):
            chunks.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        chunks.append(current)
    return chunks
