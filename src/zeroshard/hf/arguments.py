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

import os
from typing import Any

import transformers

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
