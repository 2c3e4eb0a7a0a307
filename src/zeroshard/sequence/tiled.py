"""Tiled compute along the sequence (DeepSpeed's Arctic Long Sequence Training helpers, importable from
`deepspeed.runtime.sequence_parallel.ulysses_sp` with DeepSpeed's signatures): `TiledMLP`, `sequence_tiled_compute`
(`SequenceTiledCompute`), `TiledFusedLogitsLoss`, and `AutogradComputeMLP` (the untiled form).

[Note: tiled compute]
At long sequence lengths two activations dominate memory: the MLP's intermediate ([tokens, 2-4 x hidden] per layer)
and the logits ([tokens, vocabulary], fp32 in the loss). A tiled function runs in forward over slices of the
sequence under no_grad, keeping only its input; backward recomputes one slice at a time with autograd on and
backpropagates it, so one slice's intermediates are alive at a time, at the cost of one more forward of the
function. The weights the function uses receive their gradient once per slice, in separate autograd passes, so their
post-accumulate-grad hooks fire once per slice: `compute_params` get `ds_grad_is_ready = False` for every slice
but the last (DeepSpeed's attribute, which users' own tiled code also sets), and ZeRO stages 0-2 leave the partial
sum in `.grad` until the last slice's hook takes it (flat/strategy.py); stage 3 adds every arrival into the unit's
staging buffer anyway. When the input needs no gradient but a weight does (the first layer of a model with frozen
embeddings), an empty tensor that requires grad goes in as well, so that the output requires grad and backward
runs (DeepSpeed's output then needs no grad and the weights get none).

Differences from DeepSpeed, all where DeepSpeed's result is wrong or an error:
- `TiledFusedLogitsLoss` recomputes the slices in backward like the others. DeepSpeed backpropagates them inside
  forward and multiplies only the input's gradient by the incoming one, so the weights' gradient misses every
  factor applied to the loss afterwards (gradient accumulation's 1/steps, fp16's loss scale); the price here is
  one more forward of the loss function (the lm_head matmul).
- The slice a weight's gradient is taken on is the last non-empty one: DeepSpeed flags `i + 1 < shards`, and
  `torch.chunk` can return fewer slices than asked (9 rows in 4 shards: 3), leaving the weights never ready.
- `sequence_tiled_compute` with `output_reduction` "mean"/"sum" and an output dimension other than 0 gives the
  gradient of that reduction (DeepSpeed fails); empty trailing slices (seqlen 9 in 4 shards of 3) are skipped.
- The recompute runs under forward's random number generator state and autocast, as torch.utils.checkpoint does
  (DeepSpeed's draws new dropout masks and runs in full precision under autocast: the gradient of another function).
- Another tensor among `sequence_tiled_compute`'s arguments that requires grad is refused in one line (DeepSpeed
  returns it no gradient); `TiledFusedLogitsLoss`'s `fn` must return a 0-d loss per slice (DeepSpeed's "mean" of a
  non-scalar gets a gradient k times too large); `torch.autograd.grad` through a tiled call is refused (the slices'
  passes accumulate into the weights' `.grad`), as torch's reentrant checkpoint refuses it.
- A weight the last slice does not touch (a fully masked slice) still reaches the engine: DeepSpeed's stays held.
- `compute_params=None` means the module's trainable parameters (TiledMLP, TiledFusedLogitsLoss; DeepSpeed fails)
  or no weights (`sequence_tiled_compute`, where the function is not a module).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

_REDUCTIONS = (None, "mean", "sum")


@dataclass
class _Plan:
    """How one tiled call slices its input and puts the slices' outputs together."""

    slices: Callable[[Tensor], list[Tensor]]  # a tensor shaped like the input -> views of its slices
    call: Callable[[int, Tensor], Tensor]  # slice i's output from the input's slice i
    combine: Callable[[list[Tensor]], Tensor]  # the slices' outputs -> the result
    # the result's gradient -> the gradient of slice i's output (given that output)
    split_grad: Callable[[Tensor], Callable[[int, Tensor], Tensor]]
    params: list[Tensor] = field(default_factory=list)


class _Replay:
    """What forward ran under, for backward's recompute to run under the same: the random number generators' state
    (a dropout draws the same masks) and autocast (the same precision), as torch.utils.checkpoint does."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocast_on = torch.is_autocast_enabled(device.type)
        self.autocast_dtype = torch.get_autocast_dtype(device.type)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        devices = [self.device] if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.device)
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_on):
                yield


class _HeldBack:
    """The weights' `ds_grad_is_ready` over one tiled backward ([Note: tiled compute]): False until the last slice,
    then what it was before (an enclosing tiled call may be holding them back too), and restored after, also when a
    slice raised. A weight that got a gradient on an earlier slice but none on the last (a slice whose tokens are all
    masked returns `(x * 0).sum()`) would keep its partial sum held back for good, and ranks masking differently would
    then reduce differently: `release` hands it on by accumulating zeros once more with the flag set."""

    def __init__(self, params: list[Tensor]):
        self.params = params
        self.before = [getattr(p, "ds_grad_is_ready", True) for p in params]
        self.arrived: set[int] = set()
        self.on_last: set[int] = set()
        self._last = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._arrival) for p in params]

    def _arrival(self, param: Tensor) -> None:
        (self.on_last if self._last else self.arrived).add(id(param))

    def slice(self, last: bool) -> None:
        self._last = last
        for p, before in zip(self.params, self.before, strict=True):
            p.ds_grad_is_ready = before if last else False  # type: ignore[attr-defined]

    def release(self) -> None:
        self.slice(last=True)
        for p in self.params:  # held back: still in .grad (stage 3 takes every arrival, so it holds nothing)
            if id(p) in self.arrived and id(p) not in self.on_last and p.grad is not None:
                torch.autograd.backward(p, torch.zeros_like(p))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for p, before in zip(self.params, self.before, strict=True):
            p.ds_grad_is_ready = before  # type: ignore[attr-defined]


class _Tiled(torch.autograd.Function):
    """[Note: tiled compute]; `anchor`: see `_run`."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, x: Tensor, *anchor: Tensor) -> Tensor:  # type: ignore[override]
        ctx.replay = _Replay(x.device)
        with torch.no_grad():
            outs = [plan.call(i, piece) for i, piece in enumerate(plan.slices(x))]
        ctx.plan = plan
        ctx.save_for_backward(x)
        return plan.combine(outs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        if not torch.autograd._is_checkpoint_valid():
            # the slices' passes accumulate into the weights' .grad, which torch.autograd.grad must not touch
            raise RuntimeError(
                "a tiled compute (TiledMLP, sequence_tiled_compute, TiledFusedLogitsLoss) supports .backward() and "
                "engine.backward(), not torch.autograd.grad() or backward(inputs=...)"
            )
        (x,) = ctx.saved_tensors
        plan: _Plan = ctx.plan
        wants_x = bool(ctx.needs_input_grad[1])
        # contiguous, so that a plan's reshape of it is a view the slices' gradients are written through
        x_grad = torch.empty_like(x, memory_format=torch.contiguous_format) if wants_x else None
        grad_of = plan.split_grad(grad)
        pieces = plan.slices(x)
        grad_pieces = plan.slices(x_grad) if x_grad is not None else []
        held = _HeldBack(plan.params)
        try:
            with ctx.replay():
                for i, piece in enumerate(pieces):
                    held.slice(last=i == len(pieces) - 1)
                    leaf = piece.detach().requires_grad_(wants_x)
                    with torch.enable_grad():
                        out = plan.call(i, leaf)
                    if out.requires_grad:
                        torch.autograd.backward(out, grad_of(i, out))
                    if x_grad is not None:
                        grad_pieces[i].copy_(leaf.grad) if leaf.grad is not None else grad_pieces[i].zero_()
            held.release()
        finally:
            held.close()
        return (None, x_grad) + (None,) * (len(ctx.needs_input_grad) - 2)


def _run(plan: _Plan, x: Tensor) -> Tensor:
    # an input that requires grad when only weights do, so that autograd calls backward ([Note: tiled compute]);
    # not the weights themselves: a None gradient for a leaf input still fires its hooks, the engine's included
    anchor = [torch.empty(0, device=x.device, requires_grad=True)] if plan.params and not x.requires_grad else []
    return _Tiled.apply(plan, x, *anchor)  # type: ignore[no-any-return]


def _trainable(params: Sequence[Tensor] | None, module: Any) -> list[Tensor]:
    if params is None:
        params = list(module.parameters()) if isinstance(module, nn.Module) else []
    return [p for p in params if p.requires_grad]


def _check_shards(shards: int) -> None:
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")


def _check_reduction(reduction: str | None, allowed: tuple[str | None, ...] = _REDUCTIONS) -> None:
    if reduction not in allowed:
        raise ValueError(f"unknown output_reduction {reduction!r}: valid values are {', '.join(map(str, allowed))}")


def _reduce(whole: Tensor, reduction: str | None) -> Tensor:
    return whole if reduction is None else whole.mean() if reduction == "mean" else whole.sum()


def _reduced_grad(grad: Tensor, reduction: str | None, numel: int) -> Callable[[int, Tensor], Tensor]:
    """Every element of the unreduced output gets `grad` ("sum") or `grad / numel` ("mean")."""
    each = grad / numel if reduction == "mean" else grad
    return lambda i, out: each.expand_as(out)


def _pieces(parts: Sequence[Tensor]) -> Callable[[int, Tensor], Tensor]:
    return lambda i, out: parts[i]


def _rows_plan(fn: Callable[..., Tensor], module: Any, x: Tensor, shards: int, params: list[Tensor]) -> _Plan:
    """TiledMLP: slices of the token dimension (-2) of [bs, seq, hidden] or [tokens, hidden]."""
    sizes = [piece.shape[-2] for piece in torch.chunk(x, shards, dim=-2)]
    return _Plan(
        slices=lambda t: list(t.split(sizes, dim=-2)),
        call=lambda i, piece: fn(module, piece),
        combine=lambda outs: torch.cat(outs, dim=-2),
        split_grad=lambda grad: _pieces(grad.split(sizes, dim=-2)),
        params=params,
    )


class TiledMLP:
    """[Note: tiled compute] `TiledMLP.apply(fn, self, x, shards, compute_params)`: `fn(self, x_slice)` over
    `shards` slices of x's token dimension, recomputed slice by slice in backward.

    Example (a Hugging Face MLP, patched before the model is built)::

        >>> def tiled_forward(self, x):  # doctest: +SKIP
        ...     return TiledMLP.apply(LlamaMLP.forward, self, x, 4, None)
    """

    @staticmethod
    def apply(
        fn: Callable[..., Tensor], self: Any, x: Tensor, shards: int, compute_params: Sequence[Tensor] | None = None
    ) -> Tensor:
        _check_shards(shards)
        return _run(_rows_plan(fn, self, x, shards, _trainable(compute_params, self)), x)


class AutogradComputeMLP:
    """`AutogradComputeMLP.apply(fn, self, x)`: `fn(self, x)` without keeping its intermediates, recomputed in
    backward (TiledMLP with one slice)."""

    @staticmethod
    def apply(fn: Callable[..., Tensor], self: Any, x: Tensor) -> Tensor:
        return _run(_rows_plan(fn, self, x, 1, _trainable(None, self)), x)


def sequence_tiled_compute(
    fn: Callable[..., Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: dict[str, Any],
    kwargs_to_pass: dict[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Sequence[Tensor] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: str | None = "mean",
) -> Tensor:
    """[Note: tiled compute] `fn(**kwargs_to_shard sliced on dim 1, **kwargs_to_pass)` over `shards` slices of
    `ceil(seqlen / shards)` positions; the slices' outputs concatenated along `output_unshard_dimension` (stacked
    when it is 0: one loss per slice), then reduced by `output_reduction` (None, "mean", "sum"). Only
    `kwargs_to_shard[grad_requiring_tensor_key]` receives a gradient, and the weights in `compute_params`.

    Example::

        >>> x = torch.randn(1, 10, 4, requires_grad=True)
        >>> proj = torch.nn.Linear(4, 4)
        >>> out = sequence_tiled_compute(lambda x, m: m(x), 10, 3, {"x": x}, {"m": proj}, "x", None, 1, None)
        >>> out.shape
        torch.Size([1, 10, 4])
    """
    _check_shards(shards)
    _check_reduction(output_reduction)
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not a key of kwargs_to_shard")
    others = {**kwargs_to_shard, **kwargs_to_pass}
    for key, value in others.items():
        if key != grad_requiring_tensor_key and isinstance(value, Tensor) and value.requires_grad:
            raise ValueError(
                f"{key!r} requires grad but only {grad_requiring_tensor_key!r} (grad_requiring_tensor_key) gets a "
                "gradient from a tiled compute: detach it, or tile over it instead"
            )
    step = math.ceil(seqlen / shards)
    bounds = [(start, min(step, seqlen - start)) for start in range(0, seqlen, step)]
    dim = output_unshard_dimension
    made: dict[str, Any] = {}  # what forward's combine learned: the slices' sizes along `dim`, the output's numel

    def call(i: int, piece: Tensor) -> Tensor:
        start, length = bounds[i]
        kwargs = {k: v.narrow(1, start, length) for k, v in kwargs_to_shard.items()}
        kwargs[grad_requiring_tensor_key] = piece
        return fn(**kwargs, **kwargs_to_pass)

    def combine(outs: list[Tensor]) -> Tensor:
        whole = torch.stack(outs) if dim == 0 else torch.cat(outs, dim=dim)
        made.update(sizes=[1 if dim == 0 else out.shape[dim] for out in outs], numel=whole.numel())
        return _reduce(whole, output_reduction)

    def split_grad(grad: Tensor) -> Callable[[int, Tensor], Tensor]:
        if output_reduction is not None:
            return _reduced_grad(grad, output_reduction, made["numel"])
        return _pieces(grad.unbind(0) if dim == 0 else grad.split(made["sizes"], dim=dim))

    plan = _Plan(
        slices=lambda t: [t.narrow(1, start, length) for start, length in bounds],
        call=call,
        combine=combine,
        split_grad=split_grad,
        params=_trainable(compute_params, None),
    )
    return _run(plan, kwargs_to_shard[grad_requiring_tensor_key])


class SequenceTiledCompute:
    """DeepSpeed's positional form of `sequence_tiled_compute`: `apply(fn, seqlen, shards, keys_to_shard,
    keys_to_pass, grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction, *values)`,
    the values of the keys to shard, then of the keys to pass."""

    @staticmethod
    def apply(
        fn: Callable[..., Tensor],
        seqlen: int,
        shards: int,
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_requiring_tensor_key: str,
        compute_params: Sequence[Tensor] | None,
        output_unshard_dimension: int,
        output_reduction: str | None,
        *values: Any,
    ) -> Tensor:
        if len(values) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError(f"{len(values)} values for {len(keys_to_shard) + len(keys_to_pass)} keys")
        to_shard = dict(zip(keys_to_shard, values[: len(keys_to_shard)], strict=True))
        to_pass = dict(zip(keys_to_pass, values[len(keys_to_shard) :], strict=True))
        return sequence_tiled_compute(
            fn,
            seqlen,
            shards,
            to_shard,
            to_pass,
            grad_requiring_tensor_key,
            compute_params,
            output_unshard_dimension,
            output_reduction,
        )


class TiledFusedLogitsLoss:
    """[Note: tiled compute] `TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params,
    output_reduction)`: `fn(self, x_slice, y_slice[, mask_slice])` (typically lm_head then cross-entropy) over
    `shards` slices of the flattened [batch x sequence] tokens, so that one slice's logits exist at a time; the
    slices' losses averaged ("mean") or summed ("sum"). With uneven slices or a mask, "mean" is the mean of the
    slices' means: use "sum" and divide by the token count for the token mean, as DeepSpeed advises.

    Example::

        >>> head = torch.nn.Linear(8, 32, bias=False)
        >>> def loss_fn(head, x, y):
        ...     return torch.nn.functional.cross_entropy(head(x), y)
        >>> x, y = torch.randn(1, 12, 8, requires_grad=True), torch.randint(0, 32, (1, 12))
        >>> TiledFusedLogitsLoss.apply(loss_fn, head, x, y, None, 3, None, "mean").backward()
        >>> head.weight.grad.shape
        torch.Size([32, 8])
    """

    @staticmethod
    def apply(
        fn: Callable[..., Tensor],
        self: Any,
        x: Tensor,
        y: Tensor,
        mask: Tensor | None,
        shards: int,
        compute_params: Sequence[Tensor] | None,
        output_reduction: str = "mean",
    ) -> Tensor:
        _check_shards(shards)
        _check_reduction(output_reduction, ("mean", "sum"))
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError(f"x and y must be at least 2-D [batch, seq, ...]; got {tuple(x.shape)}, {tuple(y.shape)}")
        if x.shape[:2] != y.shape[:2]:
            raise ValueError(f"x and y differ in batch/seq dims: {tuple(x.shape[:2])} vs {tuple(y.shape[:2])}")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"mask must be [batch, seq] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}")
        tokens = x.shape[0] * x.shape[1]
        sizes = [piece.shape[0] for piece in torch.chunk(torch.empty(tokens, device="meta"), shards)]
        ys = y.reshape(tokens, *y.shape[2:]).split(sizes)
        masks = None if mask is None else mask.reshape(tokens).split(sizes)

        def call(i: int, piece: Tensor) -> Tensor:
            out = fn(self, piece, ys[i]) if masks is None else fn(self, piece, ys[i], masks[i])
            if out.dim() != 0:
                raise ValueError(f"TiledFusedLogitsLoss: fn must return a 0-d loss per slice, got {tuple(out.shape)}")
            return out

        plan = _Plan(
            slices=lambda t: list(t.reshape(tokens, *t.shape[2:]).split(sizes)),
            call=call,
            combine=lambda outs: _reduce(torch.stack(outs), output_reduction),
            split_grad=lambda grad: _reduced_grad(grad, output_reduction, len(sizes)),
            params=_trainable(compute_params, self),
        )
        return _run(plan, x)


__all__ = ["AutogradComputeMLP", "SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "sequence_tiled_compute"]
