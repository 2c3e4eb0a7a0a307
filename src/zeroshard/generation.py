"""`engine.module.generate` when the engine must see generation: ZeRO-3 on several ranks, and the hybrid engine.

[Note: generation at stage 3]
Under DeepSpeed ZeRO-3, transformers' `generate` defaults `synced_gpus` to True on several ranks (it asks
`is_deepspeed_zero3_enabled()`): a rank whose sequences are done keeps running forwards until every rank's are,
because each forward all-gathers parameters and the ranks must gather together. zeroshard's stage 3 gathers the
same way, but transformers cannot tell it is there: a rank that finished early left the others waiting on a gather
(two ranks asking for 4 and 7 new tokens: "Connection closed by peer"). So at stage 3 on several ranks (and with the
hybrid engine, at any stage) `initialize` makes `engine.module.generate` the engine's `generate`, which at stage 3 on
several ranks passes `synced_gpus=True` to a `generate` that takes it, unless the call says otherwise, as
transformers does under DeepSpeed (inside a whole-model gather the extra forwards communicate nothing). Experts split
over ranks (`MoE` layers with ep_size > 1, `expert_parallel`) exchange tokens in every forward: there too, at any
stage (a rank asking for fewer tokens left the other in an all-to-all; transformers' default asks for ZeRO-3 only).
The HF Seq2SeqTrainer passes `synced_gpus` itself, from the same DeepSpeed test: zeroshard's Trainer sets it there.
It is the one method of a user's module zeroshard replaces, because the call is made there (DeepSpeed-Chat, TRL's
generation); a copy or a pickle of the module gets its class's own `generate` back, a module whose engine is gone
its own, and `engine.destroy()` puts the module's own back.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn


def own_generate(module: nn.Module) -> Callable[..., Any] | None:
    """The module's own `generate` (under an engine's wrapper, the one it wraps)."""
    found = module.__dict__.get("generate")
    if isinstance(found, EngineGenerate):
        return found.own
    found = getattr(module, "generate", None)
    return found if callable(found) else None


def synced(module: nn.Module, own: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with transformers' ZeRO-3 default `synced_gpus=True`, for a `generate` that takes it: one naming it,
    or one passing `**kwargs` on from a transformers model (PEFT's). Not with the paged cache of continuous batching,
    which ignores it."""
    if "synced_gpus" in kwargs or kwargs.get("cache_implementation") == "paged":
        return kwargs
    try:
        parameters = inspect.signature(own).parameters
    except (TypeError, ValueError):
        return kwargs
    forwards = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()) and _holds_transformers(module)
    return {**kwargs, "synced_gpus": True} if "synced_gpus" in parameters or forwards else kwargs


def _holds_transformers(module: nn.Module) -> bool:
    generation = sys.modules.get("transformers.generation.utils")
    mixin = getattr(generation, "GenerationMixin", None)
    return mixin is not None and any(isinstance(m, mixin) for m in module.modules())


def install(engine: Any) -> None:
    """[Note: generation at stage 3] `engine.module.generate` becomes `engine.generate` (the latest engine's)."""
    own = own_generate(engine.module)
    if own is not None:
        engine.module.generate = EngineGenerate(engine, own)


def uninstall(engine: Any) -> None:
    """The module gets its own `generate` back, unless another engine's wrapper is there now."""
    installed = engine.module.__dict__.get("generate")
    if isinstance(installed, EngineGenerate) and installed.engine() in (engine, None):
        del engine.module.generate


class EngineGenerate:
    """`engine.module.generate`: the engine's generate, holding the engine weakly (the module is the engine's). A
    copy or a pickle of the module gets its class's own `generate` back, bound to the copy (`__reduce__`: deepcopy
    and pickle both use it), not this engine's."""

    def __init__(self, engine: Any, own: Callable[..., Any]) -> None:
        self.engine = weakref.ref(engine)
        self._module = weakref.ref(engine.module)
        self.own = own
        functools.update_wrapper(self, own)  # the signature and docstring of the module's generate

    def __reduce__(self) -> tuple[Any, ...]:
        module: Any = self._module()
        return types.MethodType, (type(module).generate, module)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        engine = self.engine()
        if engine is None:  # the engine is gone and the module whole again: its own generate
            return self.own(*inputs, **kwargs)
        return engine.generate(*inputs, **kwargs)
