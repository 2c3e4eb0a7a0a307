"""`deepspeed.runtime.fp16.loss_scaler`: `LossScaler` (a static scale) and `DynamicLossScaler`, zeroshard's
scalers (precision/loss_scaler.py) under DeepSpeed's names, for `isinstance` and for the `add_safe_globals` lists
scripts build (runtime/zero/config.py). The constructors are zeroshard's: `LossScaler(scale)`,
`DynamicLossScaler(init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis, scale_factor=2.0)`."""

from zeroshard.precision.loss_scaler import DynamicLossScaler
from zeroshard.precision.loss_scaler import StaticLossScaler as LossScaler

__all__ = ["DynamicLossScaler", "LossScaler"]
