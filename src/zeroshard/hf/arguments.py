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
resolved by the Trainer's rules, as transformers resolves them for the plugin. An explicit `deepspeed=` wins.
"""

from __future__ import annotations

import os
from typing import Any

import transformers

ACCELERATE_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"


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
        launched = os.environ.pop(ACCELERATE_USE_DEEPSPEED, "false").lower() in ("true", "1", "yes")
        super().__post_init__()  # type: ignore[misc]
        if launched and not source and self.zeroshard_config is None:
            from accelerate.utils import DeepSpeedPlugin

            plugin = DeepSpeedPlugin()  # the launch's variables: ZeRO stage, offload, config file, clipping, ...
            plugin.set_mixed_precision(getattr(self, "mixed_precision", "no"))  # as transformers does
            self.zeroshard_config = plugin.deepspeed_config


class TrainingArguments(TrainingArgumentsMixin, transformers.TrainingArguments):
    """`transformers.TrainingArguments` with `deepspeed=` (a path or a dict, or `--deepspeed` on the command line)
    read by zeroshard's Trainer; DeepSpeed need not be installed.

    Example:
        >>> args = TrainingArguments("out", deepspeed="ds_config.json", per_device_train_batch_size=4)
        >>> args.zeroshard_config, args.deepspeed
        ('ds_config.json', None)
    """
