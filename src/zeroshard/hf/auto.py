"""The ds_config a Hugging Face Trainer run uses: "auto" filled from `TrainingArguments`, as transformers does.

[Note: the Trainer's "auto" rules]
transformers' DeepSpeed integration (`HfTrainerDeepSpeedConfig.trainer_config_process` at argument creation,
`trainer_config_finalize` once the model and the number of steps are known) fills each "auto" below from the
Trainer's arguments, and refuses a set value that contradicts them ("mismatch"). We compute the same values as
`known` for `resolve_config` (which already knows "auto", the batch triple and the hidden-size rules) and run the
same mismatch check on the user's dict, so a ds_config behaves here as it does under `deepspeed`:

    train_micro_batch_size_per_gpu   per_device_train_batch_size
    gradient_accumulation_steps      gradient_accumulation_steps
    train_batch_size                 world_size * per_device_train_batch_size * gradient_accumulation_steps
    gradient_clipping                max_grad_norm
    optimizer.params.lr / betas / eps / weight_decay    learning_rate / [adam_beta1, adam_beta2] / adam_epsilon /
                                                        weight_decay
    scheduler.params.warmup_min_lr   0 (never checked)
    scheduler.params.warmup_max_lr   learning_rate
    scheduler.params.total_num_steps the run's optimizer steps
    scheduler.params.warmup_num_steps max(1, args.get_warmup_steps(total))
    fp16.enabled / bf16.enabled      fp16 or fp16_full_eval / bf16 or bf16_full_eval
    reduce_bucket_size, stage3_prefetch_bucket_size, stage3_param_persistence_threshold
                                     h*h, 0.9*h*h, 10*h for the model's hidden size h (never checked)

A key the config leaves out keeps the ds_config default (as under DeepSpeed: no `gradient_clipping` means
DeepSpeed's default, whatever `max_grad_norm` says), except the batch keys, which `resolve_config` completes from
these values.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from zeroshard.config import ZeroshardConfig, parse_config, resolve_config
from zeroshard.config.fields import AUTO, ConfigBlock
from zeroshard.config.parse import ConfigSource
from zeroshard.errors import ConfigError
from zeroshard.integrations.ds_config import auto_paths

# keys transformers fills without comparing a set value with the Trainer's (`fill_only`)
UNCHECKED = frozenset({"scheduler.params.warmup_min_lr", "hidden_size"})


def trainer_known(args: Any, model: Any, num_training_steps: int, world_size: int) -> dict[str, object]:
    """What the Trainer's arguments say about each "auto" key ([Note: the Trainer's "auto" rules]).

    Example:
        >>> from transformers import TrainingArguments  # doctest: +SKIP
        >>> args = TrainingArguments("out", per_device_train_batch_size=4, learning_rate=1e-4)  # doctest: +SKIP
        >>> trainer_known(args, model, num_training_steps=100, world_size=2)["train_batch_size"]  # doctest: +SKIP
        8
    """
    micro, accum = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    known: dict[str, object] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": world_size * micro * accum,
        "gradient_clipping": float(args.max_grad_norm),
        "optimizer.params.lr": float(args.learning_rate),
        "optimizer.params.betas": [float(args.adam_beta1), float(args.adam_beta2)],
        "optimizer.params.eps": float(args.adam_epsilon),
        "optimizer.params.weight_decay": float(args.weight_decay),
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": float(args.learning_rate),
        "scheduler.params.total_num_steps": int(num_training_steps),
        "scheduler.params.warmup_num_steps": max(1, int(args.get_warmup_steps(num_training_steps))),
        "fp16.enabled": bool(args.fp16 or args.fp16_full_eval),
        "bf16.enabled": bool(args.bf16 or args.bf16_full_eval),
    }
    hidden = hidden_size(model)
    if hidden is not None:
        known["hidden_size"] = hidden
    return known


def hidden_size(model: Any) -> int | None:
    """The model's hidden size as transformers picks it: `hidden_size`, else the largest of `hidden_sizes`, in the
    config or its `text_config`."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if isinstance(getattr(cfg, "hidden_size", None), int):
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return max(int(h) for h in cfg.hidden_sizes)
    return None


def mismatches(user: Mapping[str, Any], known: Mapping[str, object]) -> list[str]:
    """The set (not "auto") values of `user` that contradict `known`, one line each, as transformers lists them."""
    lines = []
    for key, expected in known.items():
        if key in UNCHECKED:
            continue
        value = _lookup(user, key)
        if value is None or value == "auto":
            continue
        if not _same(value, expected):
            lines.append(f"- ds {key}={value} vs the Trainer's {expected}")
    return lines


def _lookup(user: Mapping[str, Any], dotted: str) -> Any:
    node: Any = user
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _same(value: Any, expected: object) -> bool:
    if isinstance(value, list | tuple) and isinstance(expected, list | tuple):
        return len(value) == len(expected) and all(_same(a, b) for a, b in zip(value, expected, strict=True))
    if isinstance(value, bool) or isinstance(expected, bool):
        return bool(value) == bool(expected)
    if isinstance(value, int | float) and isinstance(expected, int | float):
        return float(value) == float(expected)
    return bool(value == expected)


def trainer_config(
    source: ConfigSource | ZeroshardConfig, args: Any, model: Any, num_training_steps: int, world_size: int
) -> ZeroshardConfig:
    """Parse `source`, check it against the Trainer's arguments and resolve every "auto" from them.

    Raises ConfigError listing every set value that contradicts the arguments (transformers' rule)."""
    cfg = parse_config(source)
    known = trainer_known(args, model, num_training_steps, world_size)
    wrong = mismatches(cfg.raw or {}, known)
    if wrong:
        raise ConfigError(
            "ds_config values contradict the TrainingArguments:\n"
            + "\n".join(wrong)
            + '\nset them to "auto" (or change the arguments)'
        )
    zero = cfg.zero_optimization
    open_keys = [f"zero_optimization.{k}" for k in HIDDEN_SIZE_KEYS if getattr(zero, k) is AUTO]
    if open_keys and "hidden_size" not in known:  # transformers' rule (plain DeepSpeed takes its defaults)
        raise ConfigError(
            f'the model\'s config has neither hidden_size nor hidden_sizes, so the "auto" of {", ".join(open_keys)} '
            "cannot be filled in; set a number for each"
        )
    return _filled_raw(resolve_config(cfg, world_size=world_size, known=known))


def without_training(source: ZeroshardConfig) -> ZeroshardConfig:
    """The config of an evaluation-only engine: no optimizer and no scheduler (whose "auto" total_num_steps would be
    0), as transformers' `deepspeed_init(inference=True)` builds DeepSpeed's for an `evaluate()` before `train()`."""
    raw = None if source.raw is None else {k: v for k, v in source.raw.items() if k not in ("optimizer", "scheduler")}
    return dataclasses.replace(source, optimizer=None, scheduler=None, raw=raw)


def _filled_raw(cfg: ZeroshardConfig) -> ZeroshardConfig:
    """The config with its "auto" entries written into the mapping it keeps as given: transformers fills the dict in
    place before DeepSpeed sees it, so under the Trainer `engine.config[...]` reads the filled values."""
    raw = copy.deepcopy(dict(cfg.raw))
    for path in auto_paths(raw):
        *parents, last = path.split(".")
        node: Any = cfg
        for part in path.split("."):
            if isinstance(node, ConfigBlock):
                node = getattr(node, node.spellings().get(part, part), None)
            else:
                node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None and node is not AUTO:
            target: Any = raw
            for part in parents:
                target = target[part]
            target[last] = node
    return dataclasses.replace(cfg, raw=raw)


# the keys transformers fills in from the model's hidden size
HIDDEN_SIZE_KEYS = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
