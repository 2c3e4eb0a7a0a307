"""DeepSpeed's layer specifications: a layer described by its class and arguments, built only on its stage."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class StageSpan:
    """The PipelineModule building layers now: its num_stages and this stage's data-parallel ranks (the global
    ranks first .. first + size - 1)."""

    num_stages: int
    first: int
    size: int


_BUILDING: ContextVar[StageSpan | None] = ContextVar("zeroshard_pipe_stage_build", default=None)


@contextmanager
def building_stage_layers(span: StageSpan) -> Iterator[None]:
    """While a PipelineModule builds its stage's layers (on that stage's ranks only)."""
    token = _BUILDING.set(span)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def stage_being_built() -> StageSpan | None:
    """The stage whose layers are being built now; None outside a PipelineModule. A layer that needs process
    groups (MoE with ep_size > 1) cannot make them then: the other stages' ranks are not building it
    ([Note: expert groups in a pipeline] in moe/groups.py)."""
    return _BUILDING.get()


class LayerSpec:
    """A layer to build later: `LayerSpec(nn.Linear, 4, 8)` builds `nn.Linear(4, 8)` on the stage that owns it,
    so no rank holds the whole model (DeepSpeed's `deepspeed.pipe.LayerSpec`).

    Example:
        >>> spec = LayerSpec(nn.Linear, 4, 8)
        >>> spec.build().out_features
        8
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not issubclass(typename, nn.Module):
            raise RuntimeError("LayerSpec only supports torch.nn.Module types.")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{self.typename.__name__}(args={self.module_args}, kwargs={self.module_kwargs})"


class TiedLayerSpec(LayerSpec):
    """A layer whose parameters (`tied_weight_attr`) are shared by every use of the same `key`, on whatever stage:
    the classic case is the input embedding reused as the output projection. Each stage that uses the key holds a
    copy; the copies start equal and their gradients are summed across those stages before every step
    ([Note: tied layers]). `forward_fn(module, x)` replaces `module(x)` where given.

    Example:
        >>> first = TiedLayerSpec("embed", nn.Embedding, 16, 4)
        >>> last = TiedLayerSpec("embed", nn.Embedding, 16, 4, forward_fn=lambda m, x: x @ m.weight.t())
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | list[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
