"""`nn.Module.apply` calls made while `zero_init` builds a model, replayed when its parameters become real.

[Note: Module.apply under zero_init]
Many models initialise their weights in `__init__` with `self.apply(fn)` (nanoGPT's `_init_weights`, timm's and
research code's free functions): the children's own `reset_parameters()` runs first, then `fn` over every module.
Under `zero_init` the parameters are on the meta device, so `fn` wrote nothing and `initialize` gave them
`reset_parameters()`'s values (and a `_init_weights` of the root, the one name it looked for): a model built with
`self.apply(init_fn)` trained from another initialisation than the same model built whole, with no error.
DeepSpeed's `zero.Init` replaces `nn.Module.apply` while it is active (`override_module_apply`, default true): each
module's own parameters are gathered around `fn(module)`. zeroshard does the same while `zero_init` is active, from
the thread that entered it: `apply` records, for each module it visits that holds meta parameters of its own, the
function it applied (in call order: an inner module's apply in its constructor before the outer one's), and still
calls it on the meta module as before. When the module's parameters become real (`init_module`: at `initialize`,
or in a `GatheredParameters` block before it), the recorded functions run on it again, in order, after its
`reset_parameters()` and the root's `_init_weights` (which runs once: a recorded `_init_weights` of the root is not
run twice, so models that already matched keep their values to the bit). As under DeepSpeed, `fn(module)` sees that
module's own parameters; a function that reaches into a child from a module holding no parameters (or calls made
after the block, or `for p in model.parameters()` loops) writes meta tensors and is lost under both.
`zero_optimization.override_module_apply: false` drops the recorded calls at `initialize` (DeepSpeed then leaves
`apply` alone); a `GatheredParameters` block before `initialize` cannot know the config and replays them.
A recorded function runs twice on a module (on meta, then with values): one with side effects other than writing
the module's parameters (registering a hook) repeats them. Bound methods are held weakly, so the record does not
keep a model alive; entries go with their module, and `initialize` forgets its model's.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

ApplyFn = Callable[[nn.Module], Any]


class _Applied:
    """module -> the functions `apply` gave it while it held meta parameters, oldest first."""

    def __init__(self) -> None:
        self._calls: weakref.WeakKeyDictionary[nn.Module, list[Callable[[], ApplyFn | None]]] = (
            weakref.WeakKeyDictionary()
        )
        self.thread: int | None = None

    def record(self, module: nn.Module, fn: ApplyFn) -> None:
        # a module's bound method held strongly would keep the model alive through its own entry
        weak = inspect.ismethod(fn) and isinstance(fn.__self__, nn.Module)
        ref: Callable[[], ApplyFn | None] = weakref.WeakMethod(fn) if weak else (lambda: fn)  # type: ignore[arg-type]
        self._calls.setdefault(module, []).append(ref)

    def of(self, module: nn.Module) -> list[ApplyFn]:
        return [fn for ref in self._calls.get(module, ()) if (fn := ref()) is not None]

    def forget(self, model: nn.Module) -> None:
        for module in model.modules():
            self._calls.pop(module, None)


APPLIED = _Applied()
_ORIGINAL_APPLY = nn.Module.apply


def _visiting(fn: ApplyFn) -> ApplyFn:
    """`fn`, recording each module it visits that holds meta parameters of its own."""
    if getattr(fn, "_zeroshard_recorded", False):  # the children's apply calls pass it on
        return fn

    def visit(module: nn.Module) -> Any:
        if any(p.is_meta for p in module.parameters(recurse=False)):
            APPLIED.record(module, fn)
        return fn(module)

    visit._zeroshard_recorded = True  # type: ignore[attr-defined]
    return visit


def _recording_apply(self: nn.Module, fn: ApplyFn) -> nn.Module:
    if threading.get_ident() != APPLIED.thread:
        return _ORIGINAL_APPLY(self, fn)
    return _ORIGINAL_APPLY(self, _visiting(fn))


@contextmanager
def recording_applies() -> Iterator[None]:
    """`nn.Module.apply` records its calls from this thread for the context (entered once, by `zero_init`)."""
    APPLIED.thread = threading.get_ident()
    nn.Module.apply = _recording_apply  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.apply = _ORIGINAL_APPLY  # type: ignore[method-assign]
        APPLIED.thread = None
