"""resolve_config: replace every "auto" and complete the batch triple for a given world size.

Where a value comes from, first match wins:
1. `known[path]`, what the caller knows (dotted ds_config paths such as "optimizer.params.lr",
   plus facts such as "hidden_size"). `known` never overrides a value the config sets.
2. A rule of the Hugging Face Trainer's DeepSpeed integration, using HF's defaults when the caller
   says nothing: gradient_clipping 1.0; fp16/bf16/amp.enabled false; optimizer betas [0.9, 0.999],
   eps 1e-8, weight_decay 0.0; scheduler warmup_min_lr 0, warmup_max_lr = the optimizer lr,
   warmup_num_steps 0; reduce_bucket_size h*h, stage3_prefetch_bucket_size int(0.9*h*h) and
   stage3_param_persistence_threshold 10*h for h = known["hidden_size"] (with no hidden size known, 3.).
3. The DeepSpeed default, for keys of the blocks where DeepSpeed itself reads "auto" as "default".
Anything else ("optimizer.params.lr", "scheduler.params.total_num_steps", ...) is a ConfigError.

The batch keys follow DeepSpeed's rules (batch.py) after taking "auto" and absent values from
`known`; with nothing known, gradient_accumulation_steps ends up 1 as in the HF Trainer's default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, TypeVar

from zeroshard.config.batch import ACCUM, BATCH_KEYS, MICRO, TRAIN, complete_batch
from zeroshard.config.blocks import check_blocks
from zeroshard.config.checks import check_consistency
from zeroshard.config.elasticity import apply_elasticity
from zeroshard.config.fields import (
    AUTO,
    AutoPolicy,
    Bool,
    ConfigBlock,
    Float,
    Int,
    Kind,
    Nullable,
    default_of,
    join,
    show,
    spec_of,
)
from zeroshard.config.optimizer import check_buildable
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.errors import ConfigError
from zeroshard.utils.logging import get_logger

B = TypeVar("B", bound=ConfigBlock)


@dataclass(frozen=True)
class _Context:
    cfg: ZeroshardConfig
    known: Mapping[str, object]


Rule = Callable[[_Context, str], object]


def _const(value: object) -> Rule:
    return lambda ctx, key: value


def _hidden(scale: Callable[[int], int]) -> Rule:
    """HF's rule over the model's hidden size; None without one (DeepSpeed's default then, as a script passing
    "auto" straight to DeepSpeed gets: its zero_optimization block reads "auto" as the default)."""

    def rule(ctx: _Context, key: str) -> int | None:
        hidden = ctx.known.get("hidden_size")
        return None if hidden is None else scale(Int(minimum=1)(hidden, "hidden_size (from known)"))

    return rule


def _optimizer_lr(ctx: _Context, key: str) -> object:
    params = ctx.cfg.optimizer.params if ctx.cfg.optimizer else {}
    lr = params.get("lr")
    if lr is None or lr is AUTO:
        lr = ctx.known.get("optimizer.params.lr")
    if lr is None:
        raise ConfigError(
            f'{key} is "auto" and follows optimizer.params.lr, which nothing resolved; set a number in the '
            "config, or pass initialize a client optimizer (its lr is taken)"
        )
    return lr


RULES: Final[Mapping[str, Rule]] = MappingProxyType(
    {
        "gradient_clipping": _const(1.0),
        "fp16.enabled": _const(False),
        "bf16.enabled": _const(False),
        "optimizer.params.betas": _const([0.9, 0.999]),
        "optimizer.params.eps": _const(1e-8),
        "optimizer.params.weight_decay": _const(0.0),
        "scheduler.params.warmup_min_lr": _const(0),
        "scheduler.params.warmup_max_lr": _optimizer_lr,
        "scheduler.params.warmup_num_steps": _const(0),
        "zero_optimization.reduce_bucket_size": _hidden(lambda h: h * h),
        "zero_optimization.stage3_prefetch_bucket_size": _hidden(lambda h: int(0.9 * h * h)),
        "zero_optimization.stage3_param_persistence_threshold": _hidden(lambda h: 10 * h),
    }
)


def resolve_config(
    cfg: ZeroshardConfig, *, world_size: int, known: Mapping[str, object] | None = None
) -> ZeroshardConfig:
    """Return a new config with every "auto" resolved and the batch triple completed and checked.

    `world_size` is the data-parallel world size. `known` maps dotted ds_config paths (and
    "hidden_size") to what the caller knows; None values count as unknown. See the module doc for
    the order of sources. Raises ConfigError naming the key and what to pass when a value stays open.

    Example:
        >>> from zeroshard.config import parse_config
        >>> cfg = parse_config({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        ...                     "train_batch_size": 32, "gradient_accumulation_steps": 4})
        >>> cfg = resolve_config(cfg, world_size=2, known={"optimizer.params.lr": 1e-4})
        >>> cfg.train_micro_batch_size_per_gpu, cfg.optimizer.params["lr"]
        (4, 0.0001)
    """
    if not isinstance(cfg, ZeroshardConfig):
        raise TypeError(f"resolve_config takes the ZeroshardConfig from parse_config, not {type(cfg).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size {world_size!r} must be an int >= 1")
    ctx = _Context(cfg, _canonical_known(known or {}))
    filled: list[str] = []
    out = _resolve_block(cfg, "", ctx, filled)
    out = _apply_elasticity(out, world_size)
    out = _resolve_batch(out, world_size, ctx)
    out = dataclasses.replace(out, resolved=True)
    check_consistency(out)
    check_blocks(out)
    check_buildable(out.optimizer, out.scheduler)
    if filled:
        get_logger("zeroshard.config").info(f'zeroshard: resolved "auto": {", ".join(filled)}')
    return out


def _canonical_known(known: Mapping[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in known.items():
        if not isinstance(key, str):
            raise ConfigError(f"known: key {key!r} is not a dotted ds_config path")
        if value is not None:
            out[canonical_path(key)] = value
    return out


def canonical_path(path: str) -> str:
    """A dotted path with each key in its canonical spelling ("zero_optimization.prefetch_bucket_size"
    becomes "zero_optimization.stage3_prefetch_bucket_size"); unknown parts are kept as written."""
    parts = path.split(".")
    out: list[str] = []
    block: type[ConfigBlock] | None = ZeroshardConfig
    for index, part in enumerate(parts):
        if block is None:
            out.extend(parts[index:])
            break
        name = block.spellings().get(part, part)
        out.append(name)
        f = block.key_fields().get(name)
        spec = spec_of(f) if f is not None else None
        block = spec.block_type if spec is not None and spec.kind is Kind.BLOCK else None
    return ".".join(out)


def _resolve_block(block: B, path: str, ctx: _Context, filled: list[str]) -> B:
    changes: dict[str, object] = {}
    for name, f in block.key_fields().items():
        key = join(path, name)
        value = getattr(block, name)
        spec = spec_of(f)
        if key in BATCH_KEYS or spec is None:
            continue
        if isinstance(value, ConfigBlock):
            new = _resolve_block(value, key, ctx, filled)
            if new is not value:
                changes[name] = new
        elif value is AUTO:
            changes[name] = _resolve_key(block, f, key, ctx)
            filled.append(f"{key}={show(changes[name])}")
        elif spec.kind is Kind.PARAMS and any(entry is AUTO for entry in value.values()):
            changes[name] = _resolve_params(value, key, ctx, filled)
    return dataclasses.replace(block, **changes) if changes else block


def _resolve_key(block: ConfigBlock, f: dataclasses.Field[Any], key: str, ctx: _Context) -> object:
    spec = spec_of(f)
    assert spec is not None and spec.check is not None
    if key in ctx.known:
        return spec.check(ctx.known[key], f"{key} (from known)")
    rule = RULES.get(key)
    if rule is not None:  # a rule's None: DeepSpeed's default (`_hidden`)
        value = rule(ctx, key)
        return spec.check(default_of(f) if value is None else value, key)
    if (spec.auto or type(block).AUTO_POLICY) is AutoPolicy.DEFAULT:
        current = {name: getattr(block, name) for name in block.key_fields()}
        return type(block).dynamic_defaults(current).get(f.name, default_of(f))
    raise _unresolved(key, spec.check)


def _resolve_params(params: Mapping[str, Any], path: str, ctx: _Context, filled: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in params.items():
        key = join(path, name)
        if value is not AUTO:
            out[name] = value
            continue
        if key in ctx.known:
            out[name] = ctx.known[key]
        elif key in RULES:
            out[name] = RULES[key](ctx, key)
        else:
            raise _unresolved(key, Float())
        filled.append(f"{key}={show(out[name])}")
    return out


def _unresolved(key: str, check: object) -> ConfigError:
    if isinstance(check, Nullable):
        check = check.inner
    what = "true or false" if isinstance(check, Bool) else "a number" if isinstance(check, Int | Float) else "a value"
    return ConfigError(
        f'{key} is "auto" and nothing resolved it; set {what} in the config (the Hugging Face Trainer fills such '
        "values from its arguments; initialize alone cannot)"
    )


def _apply_elasticity(cfg: ZeroshardConfig, world_size: int) -> ZeroshardConfig:
    """An enabled `elasticity` block sets the batch triple ([Note: elasticity at initialize])."""
    if not cfg.elasticity.enabled:
        return cfg
    raw = cfg.raw if "elasticity" in cfg.raw else {**cfg.raw, "elasticity": cfg.elasticity.to_dict()}
    sizes = apply_elasticity(raw, world_size)
    assert sizes is not None
    return dataclasses.replace(
        cfg,
        train_batch_size=sizes.train_batch_size,
        train_micro_batch_size_per_gpu=sizes.train_micro_batch_size_per_gpu,
        gradient_accumulation_steps=sizes.gradient_accumulation_steps,
    )


def _resolve_batch(cfg: ZeroshardConfig, world_size: int, ctx: _Context) -> ZeroshardConfig:
    values: dict[str, int | None] = {}
    from_known: list[str] = []
    autos = [key for key in BATCH_KEYS if getattr(cfg, key) is AUTO and key not in ctx.known]
    for key in BATCH_KEYS:
        value = getattr(cfg, key)
        if value is None or value is AUTO:
            value = ctx.known.get(key)
            if value is not None:
                value = Int(minimum=1)(value, f"{key} (from known)")
                from_known.append(key)
        values[key] = value
    if autos and values[TRAIN] is None and values[MICRO] is None:  # too few numbers to derive the batch from
        raise ConfigError(
            f'{" and ".join(autos)} {"is" if len(autos) == 1 else "are"} "auto" and nothing resolved '
            f"{'it' if len(autos) == 1 else 'them'}; set numbers in the config (the Hugging Face Trainer fills "
            "such values from its arguments; initialize alone cannot)"
        )
    try:
        sizes = complete_batch(values[TRAIN], values[MICRO], values[ACCUM], world_size)
    except ConfigError as err:
        if not from_known:
            raise
        raise ConfigError(f"{err} ({', '.join(from_known)} given outside the config)") from None
    return dataclasses.replace(cfg, **dataclasses.asdict(sizes))
