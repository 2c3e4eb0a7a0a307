"""The FLOPs profile as text: DeepSpeed's report, its words and number formats ([Note: flops profile] in flops.py).

Two callers: the engine's `flops_profiler` block (flops.py), which knows the engine's sizes and wall-clock timings,
and the standalone `zeroshard.profiling.flops_profiler` API, which may know neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

_LINE = "{:<70}  {:<8}"


@dataclass
class ModuleProfile:
    """What one module (with its children) cost in the profiled forwards."""

    params: int = 0
    flops: int = 0
    duration: float = 0.0  # seconds, summed over calls

    @property
    def macs(self) -> int:
        return self.flops // 2


@dataclass
class Profile:
    """One measurement: `modules` by qualified name ("" is the model); `step` the engine step it was taken at."""

    step: int
    modules: dict[str, ModuleProfile] = field(default_factory=dict)

    @property
    def total(self) -> ModuleProfile:
        return self.modules[""]


@dataclass(frozen=True)
class EngineSizes:
    """The engine's lines of the report (DeepSpeed prints them only when the profiler knows its engine)."""

    world_size: int
    data_parallel_size: int
    model_parallel_size: int
    micro_batch_size: int


@dataclass(frozen=True)
class ReportOptions:
    """How to write one report. `at_step`: the step its header names; `timings`: the wall-clock breakdown's
    milliseconds ([Note: wall clock breakdown]), which add DeepSpeed's backward, step and iteration lines."""

    at_step: int
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    recompute_fwd_factor: float = 0.0
    engine: EngineSizes | None = None
    timings: dict[str, float] = field(default_factory=dict)


def number_to_string(num: float, precision: int = 2) -> str:
    for magnitude, units in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if num >= magnitude:
            return f"{round(num / magnitude, precision):g} {units}"
    if num >= 1 or num == 0:
        return f"{round(num, precision):g} "
    if num >= 1e-3:
        return f"{round(num / 1e-3, precision):g} m"
    return f"{round(num / 1e-6, precision):g} u"


def params_to_string(n: float) -> str:
    return number_to_string(n).replace("G", "B").strip()


def macs_to_string(n: float) -> str:
    return f"{number_to_string(n)}MACs"


def flops_to_string(n: float) -> str:
    return f"{number_to_string(n)}FLOPS"


def duration_to_string(seconds: float) -> str:
    return f"{number_to_string(seconds)}s"


def format_profile(profile: Profile, model: nn.Module, options: ReportOptions) -> str:
    total = profile.total
    timed = _timed_micro_step(options.timings)
    latency = timed[0] if timed is not None else total.duration
    mp = options.engine.model_parallel_size if options.engine is not None else 1
    lines = [
        "",
        "-------------------------- DeepSpeed Flops Profiler --------------------------",
        f"Profile Summary at step {options.at_step}:",
        "Notations:\n"
        "data parallel size (dp_size), model parallel size(mp_size),\n"
        "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
        "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
        "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
        "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n",
        *_engine_lines(options.engine),
        _LINE.format("params per GPU: ", params_to_string(total.params)),
        _LINE.format("params of model = params per GPU * mp_size: ", params_to_string(total.params * mp)),
        _LINE.format("fwd MACs per GPU: ", macs_to_string(total.macs)),
        _LINE.format("fwd flops per GPU: ", number_to_string(total.flops)),
        _LINE.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(total.flops * mp)),
        _LINE.format("fwd latency: ", duration_to_string(latency)),
        _LINE.format(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
            flops_to_string(total.flops / latency if latency else 0.0),
        ),
        *_backward_lines(total.flops, timed, options),
        "",
        "----------------------------- Aggregated Profile per GPU -----------------------------",
        *aggregated_lines(profile, model, options.module_depth, options.top_modules),
    ]
    if options.detailed:
        lines += [
            "",
            "------------------------------ Detailed Profile per GPU ------------------------------",
            "Each module profile is listed after its name in the following order: ",
            "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
            "percentage of total fwd latency, fwd FLOPS",
            "",
            *_detailed(profile, model, "", "", 0),
        ]
    lines.append("------------------------------------------------------------------------------")
    return "\n".join(lines)


def _engine_lines(engine: EngineSizes | None) -> list[str]:
    if engine is None:
        return []
    return [
        _LINE.format("world size: ", engine.world_size),
        _LINE.format("data parallel size: ", engine.data_parallel_size),
        _LINE.format("model parallel size: ", engine.model_parallel_size),
        _LINE.format("batch size per GPU: ", engine.micro_batch_size),
    ]


def _timed_micro_step(timings: dict[str, float]) -> tuple[float, float, float] | None:
    """(fwd, bwd, step) seconds of the profiled step's last micro-step (the one whose step updates the weights), from
    the wall-clock breakdown; None without it, or where forward and backward are not timed (a pipeline engine)."""
    fwd, bwd = timings.get("fwd_microstep", 0.0), timings.get("bwd_microstep", 0.0)
    if fwd <= 0.0 or bwd <= 0.0:
        return None
    return fwd / 1e3, bwd / 1e3, timings.get("step_microstep", 0.0) / 1e3


def _backward_lines(flops: int, timed: tuple[float, float, float] | None, options: ReportOptions) -> list[str]:
    """DeepSpeed's lines under wall_clock_breakdown: a backward costs 2 forwards, plus `recompute_fwd_factor` more
    where activation checkpointing recomputes forwards ([Note: flops profile])."""
    if timed is None:
        return []
    fwd, bwd, step = timed
    factor = 2 + options.recompute_fwd_factor
    iteration = fwd + bwd + step
    samples = options.engine.micro_batch_size * options.engine.world_size if options.engine is not None else 0
    return [
        _LINE.format("bwd latency: ", duration_to_string(bwd)),
        _LINE.format(
            f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ", flops_to_string(factor * flops / bwd)
        ),
        _LINE.format(
            f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
            flops_to_string((factor + 1) * flops / (fwd + bwd)),
        ),
        _LINE.format("step latency: ", duration_to_string(step)),
        _LINE.format("iter latency: ", duration_to_string(iteration)),
        _LINE.format(
            f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
            flops_to_string((factor + 1) * flops / iteration),
        ),
        _LINE.format("samples/second: ", round(samples / iteration, 2)),
    ]


def aggregated_lines(profile: Profile, model: nn.Module, module_depth: int, top_modules: int) -> list[str]:
    """Per depth, the module classes with the most params, MACs and latency (DeepSpeed's aggregated profile)."""
    by_depth: dict[int, dict[str, list[float]]] = {}
    for name in profile.modules:
        depth = 0 if name == "" else name.count(".") + 1
        m = profile.modules[name]
        row = by_depth.setdefault(depth, {}).setdefault(type(model.get_submodule(name)).__name__, [0, 0, 0.0])
        row[0] += m.macs
        row[1] += m.params
        row[2] += m.duration
    depth = len(by_depth) - 1 if module_depth == -1 else module_depth
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for d in range(min(depth, len(by_depth))):
        rows = by_depth[d]

        def top(col: int, fmt: Callable[[float], str]) -> dict[str, str]:
            ranked = sorted(rows.items(), key=lambda kv: kv[1][col], reverse=True)[:top_modules]  # noqa: B023
            return {k: fmt(v[col]) for k, v in ranked}

        lines += [
            f"depth {d}:",
            f"    params      - {top(1, params_to_string)}",
            f"    MACs        - {top(0, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return lines


def _detailed(profile: Profile, module: nn.Module, name: str, key: str, indent: int) -> list[str]:
    """The model's repr with each module's profile before its extra_repr: on the module's line for a leaf, on a line
    of its own above the children otherwise, where `nn.Module.__repr__` puts a parent's extra_repr."""
    total = profile.total
    m = profile.modules.get(name, ModuleProfile())  # a module reached again under another name: counted once

    def pct(part: float, whole: float) -> str:
        return f"{round(100 * part / whole, 2) if whole else 0:g}%"

    items = [
        f"{params_to_string(m.params)} = {pct(m.params, total.params)} Params",
        f"{macs_to_string(m.macs)} = {pct(m.macs, total.macs)} MACs",
        f"{duration_to_string(m.duration)} = {pct(m.duration, total.duration)} latency",
        flops_to_string(round(m.flops / m.duration, 2) if m.duration else 0),
    ]
    if module.extra_repr():
        items.append(module.extra_repr())
    head = " " * indent + (f"({key}): " if key else "") + type(module).__name__ + "("
    children = list(module.named_children())
    if not children:
        return [head + ", ".join(items) + ")"]
    lines = [head, " " * (indent + 2) + ", ".join(items)]
    for child_key, child in children:
        lines += _detailed(profile, child, f"{name}.{child_key}" if name else child_key, child_key, indent + 2)
    return lines + [" " * indent + ")"]
