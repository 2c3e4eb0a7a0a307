"""Where this rank's slice of a vocabulary-sharded tensor lies, agreed over the tensor-parallel group.

[Note: vocabulary shards]
A vocabulary-parallel LM head gives each tensor-parallel rank the logits of a contiguous range of token ids,
`[start, end)`. The losses over such logits (`sequence/cross_entropy.py`, `vocab_parallel_ops.py`,
`linear_cross_entropy.py`: DeepSpeed 0.19.8's `deepspeed.sequence` functions) need that range and the whole
vocabulary's size, to know which rank holds a target and to refuse a target no rank holds (it would otherwise
add a wrong, finite loss). Without explicit bounds the shards are taken to be equal and in rank order, and ranks
holding different sizes are refused; with bounds, every rank's triple (start, end, size) is all-gathered and
checked to tile `[0, vocab)` in rank order, so a wrong layout fails on every rank at once rather than training on
mixed-up ids. A group of one rank (or `None`: no tensor parallelism, as DeepSpeed's `pg_utils.is_parallel` reads
it) holds the whole vocabulary and issues no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.comm.collectives import Collectives


def group_collectives(group: Any) -> Collectives | None:
    """Collectives over `group`, or None where it spans one rank or is None (an absent parallel dimension). An
    engine's own `Collectives` (its tensor-parallel ones) are taken as they are, so their bytes are counted."""
    if group is None:
        return None
    if isinstance(group, Collectives):
        return group if group.world_size > 1 else None
    size = dist.get_world_size(group)
    return Collectives(group, size, dist.get_rank(group)) if size > 1 else None


@dataclass(frozen=True)
class VocabShard:
    """This rank's token ids `[start, end)` of a vocabulary of `vocab_size` ids."""

    start: int
    end: int
    vocab_size: int


def resolve_vocab_shard(
    local_size: int, start: int | None, end: int | None, tp_group: Any, device: torch.device
) -> VocabShard:
    """[Note: vocabulary shards] The shard of `local_size` ids this rank holds, checked across `tp_group` (a
    collective: every rank of the group calls it)."""
    if (start is None) != (end is None):
        raise ValueError("vocab_start_index and vocab_end_index must be given together (or neither)")
    comm = group_collectives(tp_group)
    if comm is None:
        if start is not None and (start != 0 or end != local_size):
            raise ValueError(
                f"vocabulary shard [{start}, {end}) on a single tensor-parallel rank must be the whole local "
                f"vocabulary [0, {local_size})"
            )
        return VocabShard(0, local_size, local_size)
    mine = [-1 if start is None else start, -1 if end is None else end, local_size]
    every = torch.empty(comm.world_size * 3, dtype=torch.long, device=device)
    comm.all_gather(every, torch.tensor(mine, dtype=torch.long, device=device), label="vocab shard layout")
    triples = every.view(comm.world_size, 3).tolist()
    explicit = [lo >= 0 for lo, _, _ in triples]
    if any(explicit) and not all(explicit):  # decided from what every rank sent: all raise together
        raise ValueError(
            "vocabulary shard bounds were given on some tensor-parallel ranks only "
            f"({[r for r, e in enumerate(explicit) if e]} of {comm.world_size}); give them on every rank or on none"
        )
    if start is None:
        sizes = [size for _, _, size in triples]
        if len(set(sizes)) > 1:
            raise ValueError(
                f"vocabulary shards of unequal sizes {sizes} over the tensor-parallel ranks: pass "
                "vocab_start_index and vocab_end_index"
            )
        triples = [[rank * local_size, (rank + 1) * local_size, local_size] for rank in range(comm.world_size)]
    expected = 0
    for rank, (lo, hi, size) in enumerate(triples):
        if size <= 0:
            raise ValueError(
                f"tensor-parallel rank {rank} holds no vocabulary ids: the vocabulary must have at least as many ids "
                "as the group has ranks"
            )
        if hi - lo != size:
            raise ValueError(
                f"tensor-parallel rank {rank}: vocabulary shard [{lo}, {hi}) does not match its {size} local logits"
            )
        if lo != expected:
            raise ValueError(
                f"tensor-parallel rank {rank}: vocabulary shard starts at {lo}, expected {expected}; the shards "
                "must tile [0, vocab) in rank order"
            )
        expected = hi
    lo, hi, _ = triples[comm.rank]
    return VocabShard(lo, hi, expected)


def check_ids_in_vocab(ids: torch.Tensor, ignore_index: int, vocab_size: int, what: str, sp_group: Any = None) -> None:
    """One line if an id other than `ignore_index` lies outside `[0, vocab_size)` (data-dependent: a sync). The
    ranks of `sp_group` hold different tokens, so they agree first (one MAX all-reduce) and all raise together
    rather than leaving the others waiting in the loss's collectives; tensor-parallel ranks hold the same ids."""
    outside = (ids != ignore_index) & ((ids < 0) | (ids >= vocab_size))
    found = bool(outside.any().item())
    comm = group_collectives(sp_group)
    if comm is not None:
        found = comm.any_true(found, ids.device)
    if not found:
        return
    if bool(outside.any().item()):
        bad = ids[outside][0].item()
        raise ValueError(f"{what} id {bad} is outside the vocabulary of {vocab_size} ids (ignore_index {ignore_index})")
    raise ValueError(
        f"a {what} id on another sequence-parallel rank is outside the vocabulary of {vocab_size} ids (ignore_index "
        f"{ignore_index})"
    )
