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
- state: with `bf16_optimizer_states` the torch optimizer creates it like its parameters, in bf16. Without it (or
  with `optimizer.params.fp32_optimizer_states: false`, DeepSpeedCPUAdam's key, which keeps bf16 moments) the state
  stays fp32 (DeepSpeed reaches this through DeepSpeedCPUAdam, so it asks for `offload_optimizer`; here any device
  works), and `step` applies DeepSpeedCPUAdam's arithmetic, fp32 math on bf16 weights: torch's Adam/AdamW
  (fused, foreach or plain, as configured) runs on fp32 copies of CHUNK elements of the masters and gradients at a
  time, against slices of the fp32 state, and each chunk is rounded back into its master; the step count advances
  once. Other optimizers step whole fp32 copies of the masters (their state keyed by the same tensors), which costs
  8 bytes per element of one step call (a parameter group at stages 1-2, a sub-group at stage 3: `sub_group_size`
  bounds it). torch's `Optimizer.load_state_dict` casts state to its parameter's dtype; hooks put the loaded fp32
  values back.
`fp16.fp16_master_weights_and_grads` is the same with fp16 (DeepSpeed: offload_optimizer and DeepSpeedCPUAdam; here
any tier): fp16 masters and gradients, fp32 state (DeepSpeed has no fp16 state key); the loss-scaled fp16 gradients
are unscaled (and clipped) in fp16 before the step's upcast, and an overflow skips the step as usual.
The update is rounded to bf16 every step: an update below half a bf16 ulp of its weight (|w| * 2**-9) is lost, the
known price of bf16 masters; keep fp32 masters (the default) where that matters. Checkpoints record the masters and
state in their dtypes and load into any mode (values are converted to the running engine's dtypes).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

# elements upcast at a time by the Adam path (32 MiB of fp32 temporaries): a multiple of every SIMD width, so a
# vectorised kernel leaves the same elements to its scalar tail as on the whole tensor, and rounds them alike
CHUNK = 1 << 22
_STATE_DTYPE: weakref.WeakKeyDictionary[torch.optim.Optimizer, torch.dtype] = weakref.WeakKeyDictionary()


def keep_state_in(optimizer: torch.optim.Optimizer, dtype: torch.dtype | None) -> None:
    """`optimizer`'s elementwise state is kept in `dtype` whatever its parameters' dtype (None: theirs)."""
    if dtype is None:
        _STATE_DTYPE.pop(optimizer, None)
        return
    _STATE_DTYPE[optimizer] = dtype
    loaded: dict[int, dict[str, torch.Tensor]] = {}

    def before_load(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        loaded.clear()
        loaded.update(
            {
                index: {k: v for k, v in values.items() if _elementwise(v) and v.dtype == dtype}
                for index, values in state_dict.get("state", {}).items()
            }
        )

    def after_load(opt: torch.optim.Optimizer) -> None:
        """The loaded fp32 values where there were some, else the loaded ones converted (from a bf16-state run)."""
        params = [p for group in opt.param_groups for p in group["params"]]
        for index, p in enumerate(params):
            state, exact = opt.state.get(p), loaded.get(index, {})
            if not state:
                continue
            for key, value in list(state.items()):
                if key in exact:
                    state[key] = exact[key].to(value.device).clone()
                elif _elementwise(value) and value.dtype != dtype:
                    state[key] = value.to(dtype)
        loaded.clear()

    optimizer.register_load_state_dict_pre_hook(before_load)
    optimizer.register_load_state_dict_post_hook(after_load)


def state_dtype(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.dtype:
    """The dtype `optimizer` keeps `param`'s elementwise state in (what a checkpoint load creates it as)."""
    kept = _STATE_DTYPE.get(optimizer)
    return kept if kept is not None and param.is_floating_point() else param.dtype


def step(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """`optimizer.step()` for `params` (the ones with `.grad` set), in the optimizer's state dtype ([Note: bf16
    master weights]); a plain step for an optimizer whose state follows its parameters."""
    dtype = _STATE_DTYPE.get(optimizer)
    low = [p for p in dict.fromkeys(params) if dtype is not None and p.grad is not None and p.dtype != dtype]
    if not low:
        optimizer.step()
        return
    assert dtype is not None
    if not _chunkable(optimizer):
        _step_upcast(optimizer, low, dtype)
        return
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    grads = [p.grad for p in low]
    for p in low:  # the rest (if any) steps as usual, these in chunks
        p.grad = None
    try:
        if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
            optimizer.step()
        for p, grad in zip(low, grads, strict=True):
            assert grad is not None  # `low` holds parameters with a gradient
            _adam_chunks(optimizer, group_of[id(p)], p, grad, dtype)
    finally:
        for p, grad in zip(low, grads, strict=True):
            p.grad = grad


def _step_upcast(optimizer: torch.optim.Optimizer, low: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Any optimizer: whole fp32 copies of `low` step (state keyed by the same tensors) and are rounded back."""
    kept = [(p, p.data, p.grad) for p in low]
    for p, data, grad in kept:
        p.data = data.to(dtype)
        p.grad = grad.to(dtype)  # type: ignore[union-attr]  # set: `step` filtered on it
    try:
        optimizer.step()
    finally:
        for p, data, grad in kept:
            data.copy_(p.data)
            p.grad = None
            p.data = data
            p.grad = grad


def _chunkable(optimizer: torch.optim.Optimizer) -> bool:
    """torch's own Adam/AdamW, with options the functional form reproduces chunk by chunk."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    return not any(g.get("capturable") or g.get("differentiable") for g in optimizer.param_groups)


def _adam_chunks(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype
) -> None:
    """One Adam/AdamW step of `p` (low precision) with fp32 state, CHUNK elements at a time."""
    from torch.optim.adam import adam

    state = optimizer.state[p]
    amsgrad = bool(group["amsgrad"])
    fused = bool(group.get("fused"))
    if not state:
        on = p.device if fused else torch.device("cpu")
        state["step"] = torch.zeros((), dtype=torch.float32, device=on)
        state["exp_avg"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
    flat_p, flat_g = p.data.view(-1), grad.view(-1)
    m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    vmax = state["max_exp_avg_sq"].view(-1) if amsgrad else None
    beta1, beta2 = group["betas"]
    advanced = state["step"]  # every chunk starts from the step count before this step
    for lo in range(0, max(flat_p.numel(), 1), CHUNK):  # an empty stand-in still counts its step
        hi = min(lo + CHUNK, flat_p.numel())
        chunk = flat_p[lo:hi].to(dtype)
        advanced = state["step"].clone()
        adam(
            [chunk],
            [flat_g[lo:hi].to(dtype)],
            [m[lo:hi]],
            [v[lo:hi]],
            [vmax[lo:hi]] if vmax is not None else [],
            [advanced],
            foreach=group.get("foreach"),
            fused=group.get("fused"),
            decoupled_weight_decay=bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))),
            amsgrad=amsgrad,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=bool(group.get("maximize")),
        )
        flat_p[lo:hi].copy_(chunk)
    state["step"] = advanced


def _elementwise(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0
