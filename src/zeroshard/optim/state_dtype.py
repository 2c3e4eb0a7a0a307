"""Optimizer state in a dtype other than the master weights': fp32 moments over bf16 masters.

[Note: bf16 master weights]
`bf16.bf16_master_weights_and_grads` (DeepSpeed 0.19, ZeRO stages 1-3) keeps the master weights and the gradients
the optimizer reads in bf16 instead of fp32; `bf16.bf16_optimizer_states` keeps the optimizer state in bf16 too.
Bytes per trainable parameter for mixed-precision Adam then go from 16 (2 compute + 4 master + 4 gradient + 8 state,
with fp32 gradients) to 12 with fp32 state and 8 with bf16 state:
- master: stage 3 keeps no separate master at all when the master tier shares the compute shard's (no optimizer
  offload, or both on the CPU): the bf16 compute shard *is* the master, as in DeepSpeed's stage 3. Stages 1-2 keep a
  bf16 copy of this rank's partition (2 bytes / N), as DeepSpeed does.
- gradients: accumulated and reduced in bf16 (`data_types.grad_accum_dtype`, when set, still decides accumulation).
- state: with `bf16_optimizer_states` the torch optimizer creates it like its parameters, in bf16. Without it the
  state stays fp32 (DeepSpeed reaches this through DeepSpeedCPUAdam's `fp32_optimizer_states`, so it asks for
  `offload_optimizer`; here any device works): each step of a group upcasts its bf16 masters and gradients to fp32
  temporaries, runs the optimizer on those (its state is created and kept in fp32, keyed by the same tensor
  objects), and rounds the result back into the masters (`states_in`). That is DeepSpeedCPUAdam's arithmetic:
  fp32 math, bf16 weights. The temporaries cost 8 bytes per element of what one step call covers (a parameter
  group at stages 1-2, a sub-group at stage 3: `sub_group_size` bounds it).
The update is rounded to bf16 every step: an update below half a bf16 ulp of its weight (|w| * 2**-9) is lost, the
known price of bf16 masters; keep fp32 masters (the default) where that matters. Checkpoints record the masters and
state in their dtypes and load into any mode (values are converted to the running engine's dtypes).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

_STATE_DTYPE: weakref.WeakKeyDictionary[torch.optim.Optimizer, torch.dtype] = weakref.WeakKeyDictionary()


def keep_state_in(optimizer: torch.optim.Optimizer, dtype: torch.dtype | None) -> None:
    """`optimizer`'s elementwise state is kept in `dtype` whatever its parameters' dtype (None: theirs)."""
    if dtype is None:
        _STATE_DTYPE.pop(optimizer, None)
    else:
        _STATE_DTYPE[optimizer] = dtype


def state_dtype(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.dtype:
    """The dtype `optimizer` keeps `param`'s elementwise state in (what a checkpoint load creates it as)."""
    kept = _STATE_DTYPE.get(optimizer)
    return kept if kept is not None and param.is_floating_point() else param.dtype


@contextmanager
def states_in(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Around `optimizer.step()`: each of `params` (with its `.grad` set) whose dtype differs from the optimizer's
    state dtype steps as an fp32 temporary, rounded back into its own storage afterwards ([Note: bf16 master
    weights]). A no-op for an optimizer whose state follows its parameters."""
    dtype = _STATE_DTYPE.get(optimizer)
    swapped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    if dtype is not None:
        for p in params:
            grad = p.grad
            if p.dtype == dtype or grad is None:
                continue
            kept = p.data
            p.data = kept.to(dtype)
            p.grad = grad.to(dtype)
            swapped.append((p, kept, grad))
    try:
        yield
    finally:
        for p, kept, grad in swapped:
            kept.copy_(p.data)
            p.grad = None
            p.data = kept
            p.grad = grad
