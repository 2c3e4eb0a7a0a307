"""Built-in ds_config presets (ms-swift's zero0..zero3_offload, "auto" values) and small model configs.

>>> from zeroshard.presets import ds_config_preset, fill_auto
>>> cfg = fill_auto(ds_config_preset("zero2"), {"train_micro_batch_size_per_gpu": 4})
>>> cfg["train_micro_batch_size_per_gpu"], cfg["zero_optimization"]["stage"]
(4, 2)
"""

from zeroshard.presets.architectures import MODEL_PRESETS, ModelPreset, model_preset
from zeroshard.presets.ds_configs import DS_CONFIG_PRESETS, ds_config_preset, fill_auto, load_ds_config

__all__ = [
    "DS_CONFIG_PRESETS",
    "MODEL_PRESETS",
    "ModelPreset",
    "ds_config_preset",
    "fill_auto",
    "load_ds_config",
    "model_preset",
]
