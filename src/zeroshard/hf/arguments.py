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
"""

from __future__ import annotations

from typing import Any

import transformers


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
        super().__post_init__()  # type: ignore[misc]


class TrainingArguments(TrainingArgumentsMixin, transformers.TrainingArguments):
    """`transformers.TrainingArguments` with `deepspeed=` (a path or a dict, or `--deepspeed` on the command line)
    read by zeroshard's Trainer; DeepSpeed need not be installed.

    Example:
        >>> args = TrainingArguments("out", deepspeed="ds_config.json", per_device_train_batch_size=4)
        >>> args.zeroshard_config, args.deepspeed
        ('ds_config.json', None)
    """
