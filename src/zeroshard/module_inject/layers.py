"""`deepspeed.module_inject.layers`: `set_autotp_mode` and `is_autotp_training_mode` ([Note: tp_model_init] in
tp/model_init.py). DeepSpeed's layer classes are not provided: zeroshard's AutoTP splits with DTensor plans."""

from zeroshard.tp.model_init import is_autotp_training_mode, set_autotp_mode

__all__ = ["is_autotp_training_mode", "set_autotp_mode"]
