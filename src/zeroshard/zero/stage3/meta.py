"""Sharded construction: build a model without any rank holding all of it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def zero_init() -> Iterator[None]:
    """Construct modules on the meta device; `initialize` (stage 3) materialises them unit by unit,
    each rank keeping only its shards. No torch constructor or nn.Module is patched: this is
    `torch.device("meta")` as a context.

    Example:
        >>> with zeroshard.zero_init():  # doctest: +SKIP
        ...     model = MyModel(config)
        >>> cfg = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        >>> engine, *_ = zeroshard.initialize(model=model, config=cfg)  # doctest: +SKIP
    """
    with torch.device("meta"):
        yield
