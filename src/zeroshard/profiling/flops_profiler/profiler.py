"""DeepSpeed's standalone FLOPs profiler: `FlopsProfiler(model)` around the forwards a script chooses, and
`get_model_profile(model, input_shape)` for one forward after warm-up.

Both count with the engine's `flops_profiler` block's `Recording` and write its report (monitor/flops.py,
[Note: flops profile]): FLOPs from torch's FlopCounterMode (matrix products, convolutions, attention), so
element-wise operations, normalisation and activations count 0 where DeepSpeed's patched functionals count them;
MACs equal DeepSpeed's. The profile goes where the report of the engine's block goes: to `output_file`, or through
zeroshard's log handlers whatever the log level, as DeepSpeed prints it ([Note: reports the log level does not
hide]), on each rank that asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from zeroshard.monitor.flops import Recording, write_report
from zeroshard.monitor.flops_report import (
    EngineSizes,
    Profile,
    ReportOptions,
    aggregated_lines,
    duration_to_string,
    flops_to_string,
    format_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from zeroshard.reporting import report
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

__all__ = [
    "FlopsProfiler",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]


class FlopsProfiler:
    """DeepSpeed's `FlopsProfiler`: counts the forwards of `model` between `start_profile()` and `stop_profile()`.

    `ds_engine` (an engine `initialize` returned) adds the world, data- and model-parallel and batch sizes to the
    report. Differences from DeepSpeed's: a backward run between start and stop is counted too (DeepSpeed counts
    the functionals a forward calls), and the report's backward lines come only from the engine's `flops_profiler`
    block.

    Example:
        >>> prof = FlopsProfiler(model)  # doctest: +SKIP
        >>> prof.start_profile()  # doctest: +SKIP
        >>> loss = model(batch)  # doctest: +SKIP
        >>> flops = prof.get_total_flops(as_string=True)  # doctest: +SKIP
        >>> prof.print_model_profile(profile_step=1)  # doctest: +SKIP
        >>> prof.end_profile()  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._recording = Recording(model)

    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Start counting from zero; modules whose type is in `ignore_list` are not timed and count only their
        children."""
        logger.info("Flops profiler started")
        self._recording.start(tuple(ignore_list or ()))
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; what was counted stays readable until `end_profile()`."""
        self._recording.stop()

    def reset_profile(self) -> None:
        self._recording.reset()

    def end_profile(self) -> None:
        """Stop and drop what was counted."""
        if not self.started:
            return
        self._recording.stop()
        self._recording.reset()
        self.started = False
        logger.info("Flops profiler finished")

    def get_total_flops(self, as_string: bool = False) -> int | str:
        flops = self._profile().total.flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self._profile().total.macs
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        duration = self._profile().total.duration
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = self._profile().total.params
        return params_to_string(params) if as_string else params

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Write DeepSpeed's report of what was counted (nothing before `start_profile()`), headed by
        `profile_step`, to `output_file` or the log."""
        if not self.started:
            return
        profile = self._profile()
        self.flops, self.macs, self.params = profile.total.flops, profile.total.macs, profile.total.params
        options = ReportOptions(
            at_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            recompute_fwd_factor=self.recompute_fwd_factor,
            engine=_sizes(self.ds_engine),
        )
        text = format_profile(profile, self.model, options)
        if output_file:
            write_report(output_file, text)
        else:
            report(text, ranks=None)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Per depth, the module classes with the most params, MACs and latency."""
        if not self.started:
            return
        report("\n".join(aggregated_lines(self._profile(), self.model, module_depth, top_modules)), ranks=None)

    def _profile(self) -> Profile:
        return self._recording.profile()


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = [],  # noqa: B006 -- DeepSpeed's signature; never mutated
    kwargs: dict[str, Any] = {},  # noqa: B006
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Sequence[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """DeepSpeed's `get_model_profile`: (flops, MACs, params) of one forward (or `generate` with `mode="generate"`)
    of `model` in eval mode after `warm_up` unprofiled ones; strings with `as_string`. `input_shape` builds one
    uninitialised input of that shape in the model's dtype and device; otherwise `args` and `kwargs` are passed.

    Example:
        >>> import torch.nn as nn
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> get_model_profile(model, input_shape=(2, 8), print_profile=False, as_string=False)
        (768, 384, 212)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, not {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode is 'forward' or 'generate', not {mode!r}")
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, not {input_shape!r}")
        first = next(model.parameters(), None)
        dtype, device = (first.dtype, first.device) if first is not None else (None, None)
        args = [torch.empty(input_shape, dtype=dtype, device=device)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs for the model")
    call = cast(Callable[..., Any], model if mode == "forward" else model.generate)
    prof = FlopsProfiler(model)
    model.eval()
    for _ in range(warm_up):
        call(*args, **kwargs)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        call(*args, **kwargs)
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        if print_profile:
            prof.print_model_profile(
                profile_step=warm_up,
                module_depth=module_depth,
                top_modules=top_modules,
                detailed=detailed,
                output_file=output_file,
            )
    finally:
        prof.end_profile()
    if as_string:
        return number_to_string(int(flops)), macs_to_string(int(macs)), params_to_string(int(params))
    return flops, macs, params


def _sizes(engine: Any) -> EngineSizes | None:
    if engine is None:
        return None
    return EngineSizes(
        world_size=int(engine.world_size),
        data_parallel_size=int(engine.dp_world_size),
        model_parallel_size=int(getattr(engine, "mp_world_size", 1)),
        micro_batch_size=int(engine.train_micro_batch_size_per_gpu()),
    )
