"""DeepSpeed's layer specifications: a layer described by its class and arguments, built only on its stage."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import nn

_STAGES_BUILT: ContextVar[int] = ContextVar("zeroshard_pipe_stages_built", default=0)


@contextmanager
def building_stage_layers(num_stages: int) -> Iterator[None]:
    """While a PipelineModule of `num_stages` stages builds its layers (on their stage's ranks only)."""
    token = _STAGES_BUILT.set(num_stages)
    try:
        yield
    finally:
        _STAGES_BUILT.reset(token)


def stages_being_built() -> int:
    """The num_stages of the PipelineModule building layers now; 0 outside one (a layer that makes process
    groups over the world, as MoE(ep_size > 1) does, cannot be built on one stage's ranks only)."""
    return _STAGES_BUILT.get()


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
