"""A frozen weight kept quantized (`QuantizedParameter`) and the linear layer over one (`QuantizedLinear`).

DeepSpeed quantizes a `QuantizedParameter` when it reaches an accelerator (its kernel is CUDA-only) and leaves it in
bf16 elsewhere; zeroshard quantizes it where it is built, on any device ([Note: fp8 groups] in
ops/fp_quantizer/quantize.py), so the CPU holds the bytes too. The parameter's data is the packed quantized tensor
(`[groups, group_size + 4]` uint8); `dequantized()` gives the values in the original dtype and shape.
A state dict written from the layer holds the packed bytes; one holding the original values (a pretrained model's
file) is quantized as it is loaded (`load_values`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from zeroshard.linear.config import QuantizationConfig
from zeroshard.linear.frozen import frozen_linear
from zeroshard.ops.fp_quantizer import FP_Quantize, Quantizer


class QuantizedParameter(nn.Parameter):
    """A frozen parameter stored quantized; `dequantized()` is its value.

    Example:
        >>> w = QuantizedParameter(torch.ones(4, 128, dtype=torch.bfloat16), quantization_config=QuantizationConfig())
        >>> w.dtype, w.dequantized().shape, bool((w.dequantized() == 1).all())
        (torch.uint8, torch.Size([4, 128]), True)
    """

    quantization_config: QuantizationConfig
    quantizer: Quantizer

    def __new__(
        cls,
        data: torch.Tensor | None = None,
        requires_grad: bool = False,
        quantization_config: QuantizationConfig | None = None,
        quantizer: Quantizer | None = None,
        **attributes: Any,
    ) -> QuantizedParameter:
        if requires_grad:
            raise ValueError("requires_grad=True is not supported with QuantizedParameter (its weight is frozen)")
        config = QuantizationConfig() if quantization_config is None else quantization_config
        if config.q_dtype != torch.uint8:
            raise ValueError(
                f"QuantizationConfig q_dtype={config.q_dtype} is not supported: the quantized bytes are kept as "
                "torch.uint8 (DeepSpeed's default), which module.to(dtype) leaves alone"
            )
        values = torch.empty(0) if data is None else data.detach()
        if quantizer is not None and values.dtype == config.q_dtype:
            # packed already: Transformers and Accelerate clone a parameter as `cls(param.data, **param.__dict__)`
            self = cls.of_packed(values, config, quantizer)
        else:
            quantizer = FP_Quantize(config) if quantizer is None else quantizer
            packed = _pack(values, config, quantizer) if values.numel() else values
            self = cls.of_packed(packed, config, quantizer)
        self.__dict__.update(attributes)
        return self

    @classmethod
    def of_packed(cls, packed: torch.Tensor, config: QuantizationConfig, quantizer: Quantizer) -> QuantizedParameter:
        """A parameter over bytes `quantizer` packed already (a copy of one whose class was lost: Transformers'
        loading re-wraps parameters as plain `nn.Parameter`s)."""
        self = torch.Tensor._make_subclass(cls, packed.detach(), False)
        self.quantization_config, self.quantizer = config, quantizer
        return self  # type: ignore[return-value]

    def dequantized(self) -> torch.Tensor:
        """The weight's values, in the dtype and shape it was built with."""
        config = self.quantization_config
        return self.quantizer.dequantize(self.data, q_bits=config.q_bits, q_mantisa_bits=config.mantissa_bits)

    def load_values(self, values: torch.Tensor) -> None:
        """Quantize `values` (the original dtype and shape, or the shape's elements flat) into this parameter."""
        shape = getattr(self.quantizer, "orig_shape", None)
        if shape is not None and values.numel() != shape.numel():
            raise ValueError(f"a quantized weight of {shape.numel()} elements cannot take {values.numel()} values")
        dtype = getattr(self.quantizer, "orig_dtype", None) or values.dtype
        self.data = _pack(
            values.detach().to(device=self.device, dtype=dtype).reshape(shape or values.shape),
            self.quantization_config,
            self.quantizer,
        )

    def offload(self, revert: bool = False) -> None:
        """DeepSpeed's hook for a parameter marked `ds_offload`: to the CPU, or back to the accelerator (`revert`)."""
        if getattr(self, "ds_offload", False):
            from zeroshard.accelerator import get_accelerator

            self.data = self.data.to(get_accelerator().current_device_name() if revert else "cpu")

    def __deepcopy__(self, memo: dict[int, Any]) -> QuantizedParameter:
        twin = torch.Tensor._make_subclass(type(self), self.data.clone(), False)
        twin.__dict__.update(copy.deepcopy(self.__dict__, memo))
        memo[id(self)] = twin
        return twin

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_rebuild, (self.data, dict(self.__dict__)))


def requantized(param: torch.Tensor, config: QuantizationConfig, quantizer: Quantizer) -> QuantizedParameter:
    """`param` as a `QuantizedParameter`: itself, its packed bytes re-wrapped, or its values quantized."""
    if isinstance(param, QuantizedParameter):
        return param
    if param.dtype == config.q_dtype and getattr(quantizer, "orig_shape", None) is not None:
        return QuantizedParameter.of_packed(param.data, config, quantizer)
    return QuantizedParameter(param.data, quantization_config=config)


def _rebuild(data: torch.Tensor, state: dict[str, Any]) -> QuantizedParameter:
    param = torch.Tensor._make_subclass(QuantizedParameter, data, False)
    param.__dict__.update(state)
    return param


def _pack(values: torch.Tensor, config: QuantizationConfig, quantizer: Quantizer) -> torch.Tensor:
    packed = quantizer.quantize(values, q_bits=config.q_bits, q_mantisa_bits=config.mantissa_bits)
    assert isinstance(packed, torch.Tensor)
    return packed


def load_quantized(param: torch.Tensor, state_dict: dict[str, Any], key: str) -> None:
    """A loaded state dict's original-dtype values for a quantized parameter: quantized in place and taken out of
    `state_dict` (the module's own loading then reports the key neither missing nor unexpected)."""
    if isinstance(param, QuantizedParameter) and key in state_dict:
        incoming = state_dict[key]
        if incoming.dtype != param.dtype:
            with torch.no_grad():
                param.load_values(incoming)
            state_dict[key] = param.data


class QuantizedLinear(nn.Linear):
    """`nn.Linear` whose weight is a `QuantizedParameter`, dequantized for each use (bf16 only, as DeepSpeed): in the
    forward and again in the backward ([Note: frozen weights rebuilt in backward] in linear/frozen.py).

    Example:
        >>> layer = QuantizedLinear(128, 4, quantization_config=QuantizationConfig(group_size=128))
        >>> layer(torch.ones(2, 128, dtype=torch.bfloat16)).shape
        torch.Size([2, 4])
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        bias: bool = False,
        quantization_config: QuantizationConfig | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ):
        if dtype != torch.bfloat16:
            raise ValueError(f"QuantizedLinear supports dtype torch.bfloat16 only, not {dtype}")
        super().__init__(input_dim, output_dim, bias=bias, dtype=dtype)
        self.weight = QuantizedParameter(self.weight.data, quantization_config=quantization_config)
        self._quantizer, self.weight_config = self.weight.quantizer, self.weight.quantization_config

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        load_quantized(self.weight, state_dict, f"{prefix}weight")
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.weight, QuantizedParameter):  # replaced by a plain parameter (`assign=True` loads)
            self.weight = requantized(self.weight, self.weight_config, self._quantizer)
        return frozen_linear(input, self.weight.dequantized, self.bias)
