"""`engine.module.generate` when the engine must see generation: ZeRO-3 on several ranks, and the hybrid engine.

[Note: generation at stage 3]
Under DeepSpeed ZeRO-3, transformers' `generate` defaults `synced_gpus` to True on several ranks (it asks
`is_deepspeed_zero3_enabled()`): a rank whose sequences are done keeps running forwards until every rank's are,
because each forward all-gathers parameters and the ranks must gather together. zeroshard's stage 3 gathers the
same way, but transformers cannot tell it is there: a rank that finished early left the others waiting on a gather
(two ranks asking for 4 and 7 new tokens: "Connection closed by peer"). So at stage 3 on several ranks, and with the
hybrid engine at any stage, `initialize` makes `engine.module.generate` the engine's `generate`, which passes
`synced_gpus=True` to a transformers model's `generate` unless the call says otherwise, as transformers does under
DeepSpeed (inside a whole-model gather the extra forwards communicate nothing). It is the one method of a user's
module zeroshard replaces, because the call is made there (DeepSpeed-Chat, TRL's generation); a copy or a pickle of
the module gets its class's own `generate` back, and `engine.destroy()` puts the module's own back.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from zeroshard.errors import ZeroshardError


def own_generate(module: nn.Module) -> Callable[..., Any] | None:
    """The module's `generate`, unless it is already an engine's."""
    found = getattr(module, "generate", None)
    return found if callable(found) and not isinstance(found, EngineGenerate) else None


def synced(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with transformers' ZeRO-3 default `synced_gpus=True` for a transformers (or PEFT) model."""
    if "synced_gpus" in kwargs or getattr(module, "generation_config", None) is None:
        return kwargs
    return {**kwargs, "synced_gpus": True}


def install(engine: Any) -> None:
    """[Note: generation at stage 3] `engine.module.generate` becomes `engine.generate`."""
    own = own_generate(engine.module)
    if own is not None:
        engine.module.generate = EngineGenerate(engine, own)


def uninstall(module: nn.Module) -> None:
    if isinstance(module.__dict__.get("generate"), EngineGenerate):
        del module.generate


class EngineGenerate:
    """`engine.module.generate`: the engine's generate, holding the engine weakly (the module is the engine's). A
    copy or a pickle of the module gets its class's own `generate` back, bound to the copy (`__reduce__`: deepcopy
    and pickle both use it), not this engine's."""

    def __init__(self, engine: Any, own: Callable[..., Any]) -> None:
        self._engine = weakref.ref(engine)
        self._module = weakref.ref(engine.module)
        self.own = own
        functools.update_wrapper(self, own)  # the signature and docstring of the module's generate

    def __reduce__(self) -> tuple[Any, ...]:
        module: Any = self._module()
        return types.MethodType, (type(module).generate, module)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        engine = self._engine()
        if engine is None:
            raise ZeroshardError("the engine this module's generate belonged to is gone")
        return engine.generate(*inputs, **kwargs)
