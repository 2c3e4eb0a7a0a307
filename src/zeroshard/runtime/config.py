"""`deepspeed.runtime.config`: the optimizer-name constants scripts compare `engine.optimizer_name()` with
(e.g. bing_bert's `from deepspeed.runtime.config import LAMB_OPTIMIZER`), and, as in DeepSpeed, every name of
`runtime.constants`. The values are DeepSpeed 0.19.8's; the optimizer names are those `config.optimizer`
uses for `optimizer_name()`. `DeepSpeedConfig` reads a ds_config as DeepSpeed's class does ([Note: DeepSpeedConfig]
in runtime/ds_config.py)."""

from zeroshard.config.optimizer import (
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    DEEPSPEED_OPTIMIZERS,
    LAMB_OPTIMIZER,
    LION_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUON_OPTIMIZER,
    MUSGD_OPTIMIZER,
)
from zeroshard.runtime import constants as _constants
from zeroshard.runtime.constants import *  # noqa: F403 - DeepSpeed's runtime.config does the same
from zeroshard.runtime.ds_config import DeepSpeedConfig

# ds_config `optimizer.params` keys of Adam/AdamW that torch's Adam lacks (read by optim.build_optimizer)
TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

__all__ = [
    "ADAGRAD_OPTIMIZER",
    "ADAMW_OPTIMIZER",
    "ADAM_OPTIMIZER",
    "ADAM_W_MODE",
    "ADAM_W_MODE_DEFAULT",
    "DEEPSPEED_OPTIMIZERS",
    "DeepSpeedConfig",
    "LAMB_OPTIMIZER",
    "LION_OPTIMIZER",
    "MUADAMW_OPTIMIZER",
    "MUADAM_OPTIMIZER",
    "MUON_OPTIMIZER",
    "MUSGD_OPTIMIZER",
    "TORCH_ADAM_PARAM",
    *(name for name in vars(_constants) if name.isupper()),
]
