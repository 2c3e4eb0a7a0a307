"""`deepspeed.linear`'s two configuration records: what `OptimizedLinear` adds to a linear layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_LLAMA_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoRAConfig:
    """A LoRA adapter beside a frozen base weight (DeepSpeed 0.19.8's fields and defaults).

    Attributes:
        lora_r: the adapter's rank.
        lora_alpha: the adapter's output is scaled by `lora_alpha / lora_r`.
        base_weight_sharding: the ranks the frozen base weight is split over (1: whole on every rank; otherwise the
            world size: each rank holds `1/base_weight_sharding` of it and the layer gathers it for its matmuls).
        offload: keep this layer's frozen base weight on the CPU between uses (zeroshard's; DeepSpeed 0.19.8 reads the
            key nowhere).
        offload_ratio: the share of the model's base-weight elements `initialize` moves to the CPU between uses, the
            first layers in the model's order first (the same in every layer, as DeepSpeed's engine asserts).
        delay_lora_init: build the adapters at `init_lora` instead of in the constructor.
        target_mods: the module names whose weights a loaded state dict gives adapters; a layer loaded under any
            other name becomes a plain linear layer (Llama's projections by default).
        regather_in_backward: zeroshard's: gather (or dequantize) the base weight again in the backward instead of
            keeping the forward's whole copy ([Note: frozen weights rebuilt in backward]); False keeps it, as DeepSpeed
            does, where ranks back-propagate through different sharded layers.

    Example:
        >>> LoRAConfig(lora_r=8, lora_alpha=16).lora_alpha / 8
        2.0
    """

    lora_r: int = 64
    lora_alpha: float = 16.0
    base_weight_sharding: int = 1
    offload: bool = False
    offload_ratio: float = 0.0
    delay_lora_init: bool = False
    target_mods: list[str] = field(default_factory=lambda: list(_LLAMA_PROJECTIONS))
    regather_in_backward: bool = True


@dataclass
class QuantizationConfig:
    """Quantization of a frozen base weight to a floating-point format of `q_bits` bits, per group of `group_size`
    elements with one fp32 scale each (DeepSpeed 0.19.8's fields and defaults).

    Attributes:
        q_bits: bits per element: 8 (zeroshard's quantizer stores fp8; other widths are refused).
        mantissa_bits: mantissa bits of the 8-bit format: 3 (e4m3) or 2 (e5m2).
        group_size: elements sharing one scale.
        q_dtype: the dtype the quantized bytes are kept in: uint8 (the fp8 bit patterns with the scales; DeepSpeed's
            default), the only one taken (a float8 dtype would be converted by `module.to(dtype)`).

    Example:
        >>> QuantizationConfig().q_bits
        8
    """

    q_bits: int = 8
    mantissa_bits: int = 3
    group_size: int = 512
    q_dtype: torch.dtype = torch.uint8
