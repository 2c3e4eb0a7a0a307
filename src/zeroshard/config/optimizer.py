"""The `optimizer` and `scheduler` blocks: a type name and its keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroshard.config.fields import Bool, ConfigBlock, Str, option, params
from zeroshard.errors import ConfigError

# DeepSpeed's own optimizer names (its runtime.config constants, same values): `engine.optimizer_name()`
# lower-cases optimizer.type when it is one of them, as DeepSpeed does.
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = (
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    LION_OPTIMIZER,
    MUON_OPTIMIZER,
)


def _type_name(value: object, path: str) -> str:
    name = Str()(value, path)
    if not name.strip():
        raise ConfigError(f'{path}: an empty string is not a type name; e.g. "AdamW"')
    return name


@dataclass(frozen=True)
class OptimizerConfig(ConfigBlock):
    """`optimizer`: which optimizer to build and its keyword arguments."""

    REQUIRED = ("type",)

    type: str = option("", 'Optimizer name, e.g. "AdamW" (DeepSpeed matches its own names ignoring case).', _type_name)
    params: dict[str, Any] = params('Keyword arguments (lr, betas, eps, weight_decay, ...); values may be "auto".')
    legacy_fusion: bool = option(False, "Legacy fused-optimizer switch (kept for compatibility).", Bool())


@dataclass(frozen=True)
class SchedulerConfig(ConfigBlock):
    """`scheduler`: which learning-rate scheduler to build and its keyword arguments."""

    REQUIRED = ("type",)

    type: str = option("", 'Scheduler name, e.g. "WarmupLR" or "WarmupCosineLR".', _type_name)
    params: dict[str, Any] = params(
        'Keyword arguments (warmup_min_lr, warmup_max_lr, warmup_num_steps, total_num_steps, ...); may be "auto".'
    )


def check_buildable(optimizer: OptimizerConfig | None, scheduler: SchedulerConfig | None) -> None:
    """Raise the ConfigError that building these blocks for a model would raise, before any model exists.

    [Note: probing the optimizer] The keys and values an optimizer takes are its constructor's (torch's
    signature for torch.optim classes), and a scheduler's are its own class's. Rather than a copy of those
    rules here, which would drift from the installed torch, the optimizer is built over one throwaway
    parameter, and the scheduler over it, by the very code initialize uses (zeroshard.optim). The import is
    inside the function: zeroshard.optim depends on the config checkers, and the schema modules on nothing
    but the config package.
    """
    from zeroshard.optim import build_lr_scheduler, probe_optimizer

    probe = probe_optimizer(optimizer.type, optimizer.params) if optimizer is not None else None
    if scheduler is None:
        return
    if probe is None:  # the client passes the optimizer; any optimizer with an lr serves the schedule
        probe = probe_optimizer("AdamW", {})
    try:
        build_lr_scheduler(scheduler.type, scheduler.params, probe)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError) as err:
        detail = " ".join(str(err).split())
        raise ConfigError(f"scheduler.params is invalid for scheduler.type={scheduler.type!r}: {detail}") from None
