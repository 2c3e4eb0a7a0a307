"""`deepspeed.utils.nvtx.instrument_w_nvtx`: a decorator that marks each call of a function as an NVTX range (its
qualified name) in a CUDA profile, as DeepSpeed's does through its accelerator; nothing is marked without CUDA."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def instrument_w_nvtx(func: _F) -> _F:
    """`func`, each call inside `range_push(func.__qualname__)` / `range_pop()`.

    Example:
        >>> @instrument_w_nvtx
        ... def step(x):
        ...     return x + 1
        >>> step(1)
        2
    """
    from zeroshard.accelerator import get_accelerator

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        accelerator = get_accelerator()
        accelerator.range_push(func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            accelerator.range_pop()

    return wrapped  # type: ignore[return-value]


__all__ = ["instrument_w_nvtx"]
