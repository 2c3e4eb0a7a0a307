"""`checkpoint(fn, *args)`: run `fn` without keeping its activations, recompute them in backward.

[Note: reentrant checkpoint] As DeepSpeed's `CheckpointFunction` (itself torch's reentrant checkpoint): forward
runs `fn` under no_grad and keeps only the inputs (storage.py decides how); backward restores the inputs and the
RNG states, runs `fn` again with grad and back-propagates through that recomputed graph. Stage 3 sees the
recompute as a forward inside backward ([Note: recompute] in zero/stage3/schedule.py). The recompute runs under the
autocast state of the forward (autograd does not carry it into backward: under `torch_autocast` the recompute ran in
fp32, another function than the forward's bf16 one; DeepSpeed's has that gap, torch's checkpoint does not). Under
no_grad (evaluation) `fn` just runs. Outputs that are not tensors are passed through; non-floating-point outputs get
no gradient.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch.profiler import record_function

from zeroshard.checkpointing import rng
from zeroshard.checkpointing.context import CONTEXT, CheckpointingContext
from zeroshard.checkpointing.storage import Kept, is_activation, keep, restore
from zeroshard.errors import ZeroshardError
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], outputs: list[Any], *args: Any) -> Any:  # type: ignore[override]
        state = CONTEXT
        with _boundary(state, "forward"), record_function("zeroshard.checkpoint.forward"):
            ctx.run = run
            ctx.rng = rng.capture(state.rng_tracker, _cuda_device(args))
            ctx.autocast = _autocast_now(args)
            with torch.no_grad():
                result = run(*args)
            ctx.kept = [keep(a, i, state) if is_activation(a, state) else a for i, a in enumerate(args)]
        outputs.append(result)
        tensors = _tensors(result)
        ctx.mark_non_differentiable(*[t for t in tensors if not t.is_floating_point()])
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        state = CONTEXT
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("zeroshard.checkpointing.checkpoint works with .backward(), not torch.autograd.grad()")
        with _boundary(state, "backward"), record_function("zeroshard.checkpoint.recompute"):
            inputs = [restore(a, state) if isinstance(a, Kept) else _detached(a) for a in ctx.kept]
            ctx.kept = None
            with _rng_restored(state, ctx.rng), contextlib.ExitStack() as autocast:
                for kwargs in ctx.autocast:  # as the forward ran: autograd does not carry it into backward
                    autocast.enter_context(torch.amp.autocast(**kwargs))
                with torch.enable_grad():
                    result = ctx.run(*inputs)
            pairs = [(o, g) for o, g in zip(_tensors(result), grads, strict=True) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[a.grad if isinstance(a, torch.Tensor) else None for a in inputs])


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` keeping only its inputs; recompute it in backward (DeepSpeed's
    `deepspeed.checkpointing.checkpoint`). The inputs are kept as `configure` / the `activation_checkpointing`
    block say: partitioned over the model-parallel group, in host memory, in contiguous buffers. Tensors passed by
    keyword take part in autograd as positional ones do (DeepSpeed's rule: they travel as trailing inputs).

    Example:
        >>> import torch
        >>> from zeroshard import checkpointing
        >>> layer = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> checkpointing.checkpoint(layer, x).sum().backward()
        >>> x.grad.shape
        torch.Size([2, 4])
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if kwargs:
        function, args = _with_keywords(function, len(args), tuple(kwargs)), (*args, *kwargs.values())
    outputs: list[Any] = []
    tensors = CheckpointFunction.apply(function, outputs, *args)
    return _merge(outputs[0], tensors)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's `deepspeed.checkpointing.non_reentrant_checkpoint`: `function(*args, **kwargs)` recomputed in
    backward through saved-tensor hooks (torch's non-reentrant checkpoint, the RNG state replayed), so inputs that
    need no gradient (token ids into an embedding) still give the layers inside theirs, and `torch.autograd.grad`
    works. How the inputs are kept is torch's: refused in one line when `configure` asked for partitioned, host or
    contiguous copies, which only `checkpoint` keeps (DeepSpeed's version keeps them for both).

    Example:
        >>> import torch
        >>> layer = torch.nn.Embedding(10, 4)
        >>> non_reentrant_checkpoint(layer, torch.tensor([1, 2])).sum().backward()
        >>> layer.weight.grad.abs().sum() > 0
        tensor(True)
    """
    kept = CONTEXT.settings
    if kept.partition_activations or kept.cpu_checkpointing or kept.contiguous_memory_optimization:
        raise ZeroshardError(
            "non_reentrant_checkpoint keeps the inputs as torch does: activation_checkpointing's "
            "partition_activations, cpu_checkpointing and contiguous_memory_optimization apply to "
            "checkpointing.checkpoint only; use it, or turn those settings off"
        )
    if kwargs:  # the function's own (torch's checkpoint would take `debug`, `preserve_rng_state`, ... as its options)
        function = functools.partial(function, **kwargs)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def _with_keywords(function: Callable[..., Any], positional: int, keys: tuple[str, ...]) -> Callable[..., Any]:
    """`function` taking its keyword arguments as trailing positional inputs (in `keys`' order)."""

    def run(*inputs: Any) -> Any:
        return function(*inputs[:positional], **dict(zip(keys, inputs[positional:], strict=True)))

    return run


def _tensors(result: Any) -> list[torch.Tensor]:
    items = result if isinstance(result, tuple | list) else (result,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _merge(result: Any, tensors: tuple[torch.Tensor, ...]) -> Any:
    """`result` with its tensors replaced by the autograd-connected ones `CheckpointFunction` returned: a tuple for a
    list or tuple, as DeepSpeed's checkpoint returns its autograd function's outputs."""
    if isinstance(result, torch.Tensor):
        return tensors[0]
    produced = iter(tensors)
    return tuple(next(produced) if isinstance(t, torch.Tensor) else t for t in result)


def _detached(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return arg.detach().requires_grad_(arg.requires_grad)
    return arg


def _autocast_now(args: tuple[Any, ...]) -> list[dict[str, Any]]:
    """The autocast state the forward runs under (the engine's torch_autocast, a caller's), for the recompute."""
    kinds = ["cpu", "cuda"] if _cuda_device(args) is not None else ["cpu"]
    return [
        {
            "device_type": kind,
            "enabled": torch.is_autocast_enabled(kind),
            "dtype": torch.get_autocast_dtype(kind),
            "cache_enabled": torch.is_autocast_cache_enabled(),
        }
        for kind in kinds
    ]


def _cuda_device(args: tuple[Any, ...]) -> torch.device | None:
    """The CUDA device of the first CUDA tensor among the inputs (None: none)."""
    if not torch.cuda.is_available():
        return None
    return next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)


class _rng_restored:  # noqa: N801 - a context manager read as a phrase
    def __init__(self, state: CheckpointingContext, saved: tuple[Any, ...]) -> None:
        self.state, self.saved = state, saved

    def __enter__(self) -> None:
        self.current = rng.capture(self.state.rng_tracker, self.saved[1][0])
        rng.restore(self.state.rng_tracker, self.saved)

    def __exit__(self, *exc: object) -> None:
        rng.restore(self.state.rng_tracker, self.current)


class _boundary:  # noqa: N801 - a context manager read as a phrase
    """synchronize_checkpoint_boundary and profile: synchronize at both ends, time the phase."""

    def __init__(self, state: CheckpointingContext, phase: str) -> None:
        self.state, self.phase = state, phase

    def __enter__(self) -> None:
        if self.state.settings.synchronize_checkpoint_boundary or self.state.settings.profile:
            _synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        settings = self.state.settings
        if settings.synchronize_checkpoint_boundary or settings.profile:
            _synchronize()
        if not settings.profile:
            return
        elapsed = time.perf_counter() - self.start
        stats = self.state.stats
        if self.phase == "forward":
            stats.forward_s += elapsed
            stats.calls += 1
        else:
            stats.backward_s += elapsed
        logger.info(f"checkpoint {self.phase}: {elapsed * 1e3:.2f} ms")


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
