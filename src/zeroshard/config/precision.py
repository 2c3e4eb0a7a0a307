"""Precision blocks: `fp16`, `bf16` (legacy spelling `bfloat16`), `data_types` and `torch_autocast`."""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.config.fields import (
    AutoPolicy,
    Bool,
    ConfigBlock,
    DType,
    Float,
    Int,
    ListOf,
    Moved,
    Nullable,
    Str,
    option,
)


@dataclass(frozen=True)
class FP16Config(ConfigBlock):
    """`fp16`: fp16 mixed precision with (dynamic) loss scaling."""

    AUTO_POLICY = AutoPolicy.DEFAULT

    enabled: bool = option(False, "Train in fp16 mixed precision.", Bool(), auto=AutoPolicy.RESOLVE)
    auto_cast: bool = option(False, "Cast floating-point model inputs to fp16.", Bool())
    loss_scale: float = option(0.0, "Static loss scale; 0 selects dynamic loss scaling.", Float(minimum=0.0))
    initial_scale_power: int = option(16, "Dynamic scaling starts at 2**initial_scale_power.", Int())
    loss_scale_window: int = option(1000, "Steps without overflow before the dynamic scale grows.", Int())
    hysteresis: int = option(2, "Overflows tolerated before the dynamic scale shrinks.", Int())
    consecutive_hysteresis: bool = option(False, "Refill hysteresis after every step without overflow.", Bool())
    min_loss_scale: int = option(1, "Lower bound of the dynamic loss scale.", Int())
    fp16_master_weights_and_grads: bool = option(False, "Keep master weights and gradients in fp16 (ZeRO 1-3).", Bool())


@dataclass(frozen=True)
class BF16Config(ConfigBlock):
    """`bf16`: bfloat16 mixed precision (no loss scaling)."""

    AUTO_POLICY = AutoPolicy.DEFAULT
    MOVED = (Moved("check_overflow", ("check_grad_overflow",)),)

    enabled: bool = option(False, "Train in bf16 mixed precision.", Bool(), auto=AutoPolicy.RESOLVE)
    immediate_grad_update: bool = option(False, "Apply gradient updates immediately rather than delayed.", Bool())
    check_grad_overflow: bool = option(True, "Skip the step when gradients overflow.", Bool())
    bf16_master_weights_and_grads: bool = option(False, "Keep master weights and gradients in bf16 (ZeRO 1-3).", Bool())
    bf16_optimizer_states: bool = option(
        False, "Keep optimizer states in bf16 (needs bf16_master_weights_and_grads).", Bool()
    )


def _keep_in_fp32(value: object, path: str) -> object:
    """ "auto" (the model's own list) or a list of module-name patterns."""
    if value == "auto":
        return "auto"
    return ListOf(Str())(value, path)


@dataclass(frozen=True)
class DataTypesConfig(ConfigBlock):
    """`data_types`: dtypes that differ from the mixed-precision dtype."""

    grad_accum_dtype: str | None = option(
        None,
        "Gradient accumulation dtype (fp32, fp16 or bf16); null follows the model dtype.",
        Nullable(DType()),
    )
    param_dtype: str | None = option(None, "Cast parameters to this dtype; null keeps them.", Nullable(DType()))
    buffer_dtype: str | None = option(None, "Cast buffers to this dtype; null keeps them.", Nullable(DType()))
    keep_in_fp32_modules: str | tuple[str, ...] = option(
        "auto",
        '"auto" (the model\'s own list) or name patterns of modules whose buffers stay fp32.',
        _keep_in_fp32,
        auto=AutoPolicy.LITERAL,
    )


@dataclass(frozen=True)
class TorchAutocastConfig(ConfigBlock):
    """`torch_autocast`: run the forward under torch.autocast."""

    enabled: bool = option(False, "Wrap the forward in torch.autocast.", Bool())
    dtype: str | None = option(None, "Autocast dtype (fp16 or bf16).", Nullable(DType()))
    lower_precision_safe_modules: tuple[str, ...] | None = option(
        None, "Qualified class names of modules safe to run in lower precision.", Nullable(ListOf(Str()))
    )
