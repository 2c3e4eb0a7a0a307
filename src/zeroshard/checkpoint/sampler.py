"""A DistributedSampler that can save and restore its position, across world sizes.

[Note: data position]
DistributedSampler deals out the epoch's permutation (padded to a multiple of the world size) like
cards: rank r takes positions r, r + N, r + 2N, ... So after every rank has drawn c samples, the
samples drawn by all ranks together are exactly the first c * N positions of the permutation, whatever
N is. The position is therefore one world-size-free number, `consumed` (global samples drawn this
epoch). On resume with M ranks, rank r continues with positions consumed + r, consumed + r + M, ...:
the same samples, in the same order, as an uninterrupted run when M == N, and the rest of the epoch
with no repeats and no omissions when M != N.

`consumed` counts the indices handed to the DataLoader. With `num_workers > 0` the loader prefetches
(`prefetch_factor * num_workers` batches), and prefetched batches count as consumed: use
`num_workers=0` or keep the prefetched batches in mind when resuming. Without a `load_state_dict` the
sampler is exactly torch's DistributedSampler.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler[Any]):
    """DistributedSampler with `state_dict()` / `load_state_dict()`; see [Note: data position].

    Example:
        >>> s = ResumableDistributedSampler(range(10), num_replicas=2, rank=0, shuffle=False)
        >>> it = iter(s); [next(it) for _ in range(2)]
        [0, 2]
        >>> state = s.state_dict()
        >>> t = ResumableDistributedSampler(range(10), num_replicas=1, rank=0, shuffle=False)
        >>> t.load_state_dict(state); list(t)
        [4, 5, 6, 7, 8, 9]
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._consumed = 0  # global samples drawn from the current epoch
        self._resume_from = 0  # where the next iteration of this epoch starts

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._resume_from = 0
            self._consumed = 0
        super().set_epoch(epoch)

    def _global_order(self) -> list[int]:
        """The epoch's permutation padded or cut to total_size, as DistributedSampler builds it."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=g).tolist()  # type: ignore[arg-type]
        else:
            indices = list(range(len(self.dataset)))  # type: ignore[arg-type]
        if not self.drop_last:
            padding = self.total_size - len(indices)
            if padding <= len(indices):
                indices += indices[:padding]
            else:
                indices += (indices * -(-padding // len(indices)))[:padding]
        else:
            indices = indices[: self.total_size]
        return indices

    def __iter__(self) -> Iterator[int]:
        start = self._resume_from
        self._resume_from = 0
        self._consumed = start
        order = self._global_order()
        # Cut the rest to a multiple of the world size so that every rank draws the same count.
        usable = start + (len(order) - start) // self.num_replicas * self.num_replicas
        for index in order[start + self.rank : usable : self.num_replicas]:
            self._consumed += self.num_replicas
            yield index
        self._consumed = len(order)

    def __len__(self) -> int:
        remaining = max(0, self.total_size - self._resume_from)
        return remaining // self.num_replicas

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self._consumed, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue epoch `state["epoch"]` after its first `state["consumed"]` global samples."""
        self.epoch = int(state["epoch"])
        self._consumed = self._resume_from = int(state["consumed"])
