"""Mixed precision: fp16 loss scaling."""

from zeroshard.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaler,
    StaticLossScaler,
    build_loss_scaler,
    has_inf_or_nan,
)

__all__ = ["DynamicLossScaler", "LossScaler", "StaticLossScaler", "build_loss_scaler", "has_inf_or_nan"]
