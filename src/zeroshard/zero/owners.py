"""Which strategy owns a parameter, for the APIs DeepSpeed gives only a parameter (no engine).

[Note: parameter registry]
DeepSpeed's `GatheredParameters` and `safe_get_full_fp32_param` and friends receive parameters alone, so the
strategy holding a parameter's shards must be found from the parameter. Rather than bolting attributes onto
`nn.Parameter`, every strategy (stages 0-3) registers its trainable parameters in `OWNERS` (weak references
both ways, removed on destroy). It is the one piece of process-wide state in zeroshard, and it holds nothing
alive. (Stage 3 also sets DeepSpeed's `ds_*` attributes for scripts that read them, [Note: DeepSpeed's parameter
attributes] in zero/stage3/ds_param.py; zeroshard itself never reads them.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from zeroshard.zero.strategy import Strategy


class _Owners:
    def __init__(self) -> None:
        self._by_param: dict[int, tuple[weakref.ref[nn.Parameter], weakref.ref[Strategy]]] = {}

    def register(self, strategy: Strategy, params: Iterable[nn.Parameter]) -> None:
        ref = weakref.ref(strategy)
        for p in params:
            self._by_param[id(p)] = (weakref.ref(p), ref)

    def unregister(self, params: Iterable[nn.Parameter]) -> None:
        for p in params:
            self._by_param.pop(id(p), None)

    def strategy_of(self, param: torch.Tensor) -> Strategy | None:
        entry = self._by_param.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]()


OWNERS = _Owners()

T = TypeVar("T")


def weak_hook(owner: T, call: Callable[[T, Any], None]) -> Callable[[Any], None]:
    """A tensor hook that runs `call(owner, arg)` while `owner` lives and holds it weakly.

    [Note: tensor hooks hold their owner weakly]
    torch keeps a tensor's hooks (`register_hook`, `register_post_accumulate_grad_hook`) in C++, where Python's
    garbage collector cannot follow them: a hook that refers to the strategy holding the parameter closes a cycle
    the collector never frees, so an engine dropped without `destroy()` kept its model, shards, master weights and
    optimizer state for the life of the process (every stage did). A hook that refers to its owner weakly, and to
    nothing else but numbers, leaves the strategy to the ordinary collector; once it is gone the hook does nothing.
    """
    ref = weakref.ref(owner)

    def hook(arg: Any) -> None:
        live = ref()
        if live is not None:
            call(live, arg)

    return hook
