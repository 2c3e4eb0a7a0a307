"""`TrainingArguments` whose `deepspeed=` / `--deepspeed` is read by zeroshard, not by DeepSpeed.

[Note: why our own TrainingArguments]
`transformers.TrainingArguments.__post_init__` acts on `deepspeed=` at once: it builds `HfTrainerDeepSpeedConfig`
(which checks that DeepSpeed is installed), registers it as a module-level global so that `from_pretrained`
constructs every later model under `deepspeed.zero.Init`, creates accelerate's `DeepSpeedPlugin` and starts the
process group in accelerate's DEEPSPEED mode. By the time a Trainer sees the arguments, all of that has happened
(or failed, without DeepSpeed). The only clean place to intervene is before `__post_init__` runs on the value:
`TrainingArgumentsMixin.__post_init__` moves `deepspeed` to `zeroshard_config` and clears it, then lets
transformers finish as for any run without DeepSpeed. No transformers code is patched; the class is an ordinary
subclass, so `HfArgumentParser(zeroshard.hf.TrainingArguments)` parses `--deepspeed ds_config.json` unchanged and
the arguments pickle into `training_args.bin` as usual.

[Note: accelerate launch's DeepSpeed for the Trainer]
`accelerate launch` with DeepSpeed selected (and `zeroshard accelerate-launch`, [Note: accelerate launch without
DeepSpeed]) gives no `--deepspeed` to the script: it sets `ACCELERATE_USE_DEEPSPEED` and the ZeRO settings in the
environment, and transformers builds accelerate's `DeepSpeedPlugin` from them, which puts accelerate (the process
group, the Trainer's Accelerator) in DeepSpeed mode. `TrainingArgumentsMixin.__post_init__` takes the variable out
of this process's environment before transformers reads it, and afterwards takes the plugin's config (built from the
same variables by accelerate, with transformers' mixed precision) as `zeroshard_config`: its "auto" values are then
resolved by the Trainer's rules, as transformers resolves them for the plugin. An explicit `deepspeed=` (or a
Trainer's `zeroshard_config=`) wins. The process remembers the launch (`launched_with_deepspeed`), for a later
`zeroshard.hf.Accelerator` or TrainingArguments.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import transformers

from zeroshard.config import ZeroshardConfig, parse_config
from zeroshard.errors import ConfigError

ACCELERATE_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
_taken = False  # a TrainingArguments took the variable out of this process's environment


def launched_with_deepspeed() -> bool:
    """Whether `accelerate launch` started this process with DeepSpeed selected: its variable is set, or a
    TrainingArguments took it ([Note: accelerate launch's DeepSpeed for the Trainer]); zeroshard.hf.Accelerator
    asks too."""
    return _taken or os.environ.get(ACCELERATE_USE_DEEPSPEED, "false").lower() in ("true", "1", "yes")


class TrainingArgumentsMixin:
    """Put in front of any `TrainingArguments` dataclass (e.g. TRL's `SFTConfig`) so that its `deepspeed` value
    goes to zeroshard ([Note: why our own TrainingArguments]).

    Example:
        >>> from trl import SFTConfig  # doctest: +SKIP
        >>> class Config(TrainingArgumentsMixin, SFTConfig):  # doctest: +SKIP
        ...     pass
        >>> Config("out", deepspeed="ds_config.json").zeroshard_config  # doctest: +SKIP
        'ds_config.json'
    """

    # no annotation for `deepspeed`: HfArgumentParser reads the field's type from the class's type hints
    zeroshard_config: Any = None

    def __post_init__(self) -> None:
        source = getattr(self, "deepspeed", None)
        if source:
            self.zeroshard_config = source
            setattr(self, "deepspeed", None)  # noqa: B010 - the partner dataclass's field
        # [Note: accelerate launch's DeepSpeed for the Trainer]
        global _taken
        launched = launched_with_deepspeed()
        _taken = launched
        os.environ.pop(ACCELERATE_USE_DEEPSPEED, None)
        super().__post_init__()  # type: ignore[misc]
        if launched and not source and self.zeroshard_config is None:
            self.zeroshard_config = _launched_config(self)
            self._zeroshard_config_launched = True  # a Trainer's zeroshard_config= wins over it


def _launched_config(args: Any) -> dict[str, Any]:
    """accelerate's `DeepSpeedPlugin` config from the launch's variables (ZeRO stage, offload, config file,
    clipping, accumulation), with the mixed precision transformers gives it and the MoE classes accelerate makes
    ZeRO-3 leaves."""
    from accelerate.utils import DeepSpeedPlugin

    from zeroshard.config.zero import LeafModuleConfig

    plugin = DeepSpeedPlugin()
    flag = "fp16" if args.fp16 else "bf16" if args.bf16 else None  # as transformers 4.x and 5.x choose it
    plugin.set_mixed_precision(flag or os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    config: dict[str, Any] = plugin.deepspeed_config
    moe = os.environ.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES")
    if moe:  # accelerate's transformer_moe_cls_names: gathered whole at ZeRO-3 ([Note: leaf modules])
        leaf = config.setdefault("zero_optimization", {}).setdefault("leaf_module", {})
        leaf["classes"] = [*leaf.get("classes", LeafModuleConfig().classes), *moe.split(",")]
    return config


class TrainingArguments(TrainingArgumentsMixin, transformers.TrainingArguments):
    """`transformers.TrainingArguments` with `deepspeed=` (a path or a dict, or `--deepspeed` on the command line)
    read by zeroshard's Trainer; DeepSpeed need not be installed.

    Example:
        >>> args = TrainingArguments("out", deepspeed="ds_config.json", per_device_train_batch_size=4)
        >>> args.zeroshard_config, args.deepspeed
        ('ds_config.json', None)
    """


def config_source(args: Any, zeroshard_config: Any) -> ZeroshardConfig:
    """The parsed ds_config, from `args` (zeroshard's TrainingArguments) or `zeroshard_config=`."""
    if getattr(args, "deepspeed", None):
        raise ConfigError(
            "the TrainingArguments carry deepspeed=, which transformers has already handed to DeepSpeed; use "
            "zeroshard.hf.TrainingArguments (or put zeroshard.hf.TrainingArgumentsMixin in front of your config "
            "class), or leave deepspeed unset and pass zeroshard_config= to the Trainer"
        )
    from_args = getattr(args, "zeroshard_config", None) if isinstance(args, TrainingArgumentsMixin) else None
    if getattr(args, "_zeroshard_config_launched", False) and zeroshard_config is not None:
        from_args = None  # the Trainer's own config wins over accelerate launch's variables
    if from_args is not None and zeroshard_config is not None:
        raise ConfigError("a ds_config came from both TrainingArguments(deepspeed=...) and zeroshard_config=")
    source = zeroshard_config if zeroshard_config is not None else from_args
    if source is None:
        raise ConfigError(
            "no ds_config: pass deepspeed= (or --deepspeed) to zeroshard.hf.TrainingArguments, or zeroshard_config= "
            "to the Trainer, or launch with accelerate's DeepSpeed config (zeroshard accelerate-launch)"
        )
    return parse_config(source)


def trainer_arguments(init: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The partner Trainer's arguments by name, however they were passed (transformers' Trainer takes (model, args,
    ...), TRL's DPO (model, ref_model, args, ...)); a constructor taking `*args` leaves the positions to the Trainer's
    order."""
    named = dict(kwargs)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    try:
        parameters = inspect.signature(init).parameters
        bound = inspect.signature(init).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):  # (its own error comes from its constructor)
        parameters, bound = {}, {}  # type: ignore[assignment]
    named.update({k: v for k, v in bound.items() if parameters[k].kind not in variadic})
    by_position = not bound or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values())
    if by_position and "args" not in named and len(args) > 1:
        named["args"] = args[1]
    return named


def refuse_precompute_at_stage3(source: ZeroshardConfig, training_args: Any, ref_model: Any) -> None:
    """TRL's DPO computes the reference log-probs in its constructor; without a ref_model it runs the trained model
    there, which at stage 3 is still on the CPU (or the meta device) while its batches are on the GPU (DeepSpeed wraps
    it in an inference engine at that point)."""
    if (
        int(source.zero_optimization.stage) == 3
        and getattr(training_args, "precompute_ref_log_probs", False)
        and ref_model is None
        and training_args.device.type == "cuda"
    ):
        raise ConfigError(
            "precompute_ref_log_probs without a ref_model at ZeRO-3: TRL runs the model in its constructor, before "
            "the engine places and shards it; pass ref_model= (sharded at stage 3), or precompute at stage 2"
        )


def refuse_best_model_without_checkpoint(training_args: Any) -> None:
    """`load_best_model_at_end` loads the best checkpoint's engine files (`_load_best_model`), which `save_only_model`
    leaves out; transformers refuses the pair under DeepSpeed when the Trainer is built."""
    if getattr(training_args, "save_only_model", False) and getattr(training_args, "load_best_model_at_end", False):
        raise ConfigError(
            "save_only_model with load_best_model_at_end is not supported (DeepSpeed refuses it too): the best model "
            "is loaded from a checkpoint's engine files, which save_only_model leaves out; drop one of the two"
        )
