"""DeepSpeed's `RepeatingLoader`: iterate a loader forever, restarting it when it ends."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """Wrap an iterable (a DataLoader) so `next()` never raises StopIteration: a new pass starts instead.

    Example:
        >>> it = RepeatingLoader([1, 2])
        >>> [next(it) for _ in range(5)]
        [1, 2, 1, 2, 1]
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            # A DataLoader with a DistributedSampler reshuffles on the new pass only if set_epoch was called.
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
