"""`load_checkpoint(..., custom_load_fn=f)`: the module's weights go through the caller's function.

[Note: custom_load_fn]
DeepSpeed calls `f(src=module_state_dict, dst=module)` in place of `module.load_state_dict`: scripts rename keys (a
model saved under `torch.compile`'s `_orig_mod.`), keep some prefixes, skip tensors whose shapes changed, and leave
the rest at their initial values. Here `src` is the checkpoint's module state dict, every tensor whole on the CPU in
the dtype it was saved in (tied names each present, frozen parameters left out by `exclude_frozen_parameters`
absent), read by every rank before anything is written, and `dst` the module, gathered at stage 3; rank 0's result
becomes every rank's and the master weights follow it (`engine.load_module_state_dict`'s call, whose failures are
raised on every rank; at stage 3 it gathers the whole module, as DeepSpeed does without the optimizer state).
`load_module_strict` does not apply, as in DeepSpeed. The rest of the load then runs without loading module weights
by name: where it restores master weights (`load_optimizer_states`), those of every parameter the checkpoint holds
under the engine's name come back with their optimizer state and the module weights are rebuilt from them, as
DeepSpeed's ZeRO and mixed-precision optimizers restore their fp32 masters over what the function wrote (DeepSpeed
leaves the module on the function's values until its first step, whose gradient is taken there: its first step after
such a load differs from a plain load's, zeroshard's does not); the other parameters keep the function's values with
fresh optimizer state. At fp32 stage 0, where the masters are the parameters and DeepSpeed's optimizer is torch's
own (its state loads, the parameters stay), the function's values stay and the optimizer state loads. A function
that raises (on any rank) may have written part of the module, buffers included, so the engine is left torn ([Note:
a torn load]) until a load succeeds. Refused in one line: a module that holds slices or a part of the model (tensor
parallelism, experts on other ranks), as the function would get whole tensors for it, the fsdp2 backend (its
parameters are DTensors: `load_module_state_dict`'s refusal) and a pipeline (DeepSpeed asserts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.load_plan import LoadPlan
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.checkpoint.reshard import MODEL, CheckpointReader


def refuse(engine: CheckpointableEngine, plan: LoadPlan) -> None:
    """A one-line refusal where this engine's module cannot take whole tensors from a custom load function (the same
    on every rank: nothing was written)."""
    why = engine.strategy.module_load_refused() if engine.strategy is not None else None
    if why is not None:
        raise CheckpointError(f"load_checkpoint(custom_load_fn=...): {why}; nothing was loaded")
    if plan.caller_split or any(isinstance(p, DTensor) for p in engine.module.parameters()):
        why = "its module holds tensor-parallel slices"
    elif set(plan.catalog.infos) - set(plan.catalog.tensors):
        why = "its module holds a part of the model's experts (expert parallelism)"
    if why is not None:
        raise CheckpointError(
            f"load_checkpoint(custom_load_fn=...) is not supported here: {why}, and the function would get whole "
            "tensors; load without it (by the checkpoint's names), nothing was loaded"
        )


def module_state(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """The checkpoint's module state dict: every saved tensor whole, on the CPU, in its stored dtype."""
    meta = reader.metadata
    state: dict[str, torch.Tensor] = {}
    for name, info in meta.tensors.items():
        if reader.has(MODEL, name) or info.numel == 0:
            state[name] = reader.read_tensor(MODEL, name)
    for alias, canonical in meta.aliases.items():
        if canonical in state:
            state[alias] = state[canonical]
    return state


def apply(engine: Any, plan: LoadPlan, fn: Callable[..., Any]) -> None:
    """Run `fn` over the checkpoint's module state dict and the module (collective: every rank, after every rank
    passed the load's checks). A rank that cannot read the state raises inside the module load, so every rank
    raises."""
    state: dict[str, torch.Tensor] = {}
    unreadable: Exception | None = None
    try:
        state = module_state(plan.open())
    except Exception as err:  # noqa: BLE001 - raised inside the module load on this rank, so on every rank
        unreadable = err

    def load(src: dict[str, torch.Tensor], dst: torch.nn.Module) -> None:
        if unreadable is not None:
            raise unreadable
        fn(src=src, dst=dst)

    engine.load_module_state_dict({"module": state}, custom_load_fn=load)
