"""zeroshard under a Hugging Face `Trainer` (or TRL's trainers): the two-line change.

    from zeroshard.hf import Trainer, TrainingArguments   # was: from transformers import Trainer, TrainingArguments
    zeroshard launch --nproc-per-node 8 train.py --deepspeed ds_config.json ...   # was: deepspeed train.py ...

`TrainingArguments(deepspeed=...)` keeps the ds_config for zeroshard instead of DeepSpeed
([Note: why our own TrainingArguments]); `Trainer` fills its "auto" values from the arguments as transformers
does ([Note: the Trainer's "auto" rules]) and trains through the engine ([Note: which Trainer methods we
override]). For TRL: `class SFT(TrainerMixin, SFTTrainer)` and `class Config(TrainingArgumentsMixin, SFTConfig)`.
An Accelerate script written for DeepSpeed: `from zeroshard.hf import Accelerator` (was: from accelerate import
Accelerator), [Note: Accelerate's DeepSpeed path on zeroshard].
"""

from zeroshard.hf.accelerator import Accelerator
from zeroshard.hf.arguments import TrainingArguments, TrainingArgumentsMixin
from zeroshard.hf.auto import trainer_config, trainer_known
from zeroshard.hf.trainer import Trainer, TrainerMixin

__all__ = [
    "Accelerator",
    "Trainer",
    "TrainerMixin",
    "TrainingArguments",
    "TrainingArgumentsMixin",
    "trainer_config",
    "trainer_known",
]
