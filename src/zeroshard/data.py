"""The training dataloader `initialize` builds when it is given `training_data`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler


def build_dataloader(
    dataset: Dataset[Any],
    micro_batch_size: int,
    rank: int,
    world_size: int,
    collate_fn: Callable[..., Any] | None = None,
    drop_last: bool = False,
    seed: int = 0,
) -> DataLoader[Any]:
    """Each rank reads its own 1/world_size of every epoch, `micro_batch_size` samples at a time
    (DistributedSampler with shuffling, as DeepSpeed's dataloader does)."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last)
