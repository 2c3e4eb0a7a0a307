"""`OptimizedLinear` and `LoRAOptimizedLinear`: DeepSpeed 0.19.8's linear layer with a LoRA adapter over a frozen
base weight that may be sharded over the ranks and quantized.

[Note: sharded base weights]
With `base_weight_sharding` equal to the world size each rank builds and keeps only its `1/world` of the frozen
base weight, as a flat tensor (DeepSpeed's layout: rank r holds elements [r*n, (r+1)*n) of the row-major weight);
the layer all-gathers the whole weight over the world for its matmul, in the forward and again in the backward
([Note: frozen weights rebuilt in backward] in frozen.py), and keeps none of it between uses. The shards are
rank-local: the engine does not broadcast them from the first rank (DeepSpeed's `ds_optim_param` mark), ZeRO stage 3
and the fsdp2 backend refuse them (they shard every parameter themselves: use base_weight_sharding=1 there), a
checkpoint leaves them out (`save_checkpoint` leaves out the frozen parameters, as `exclude_frozen_parameters=True`:
the base weights come from the pretrained files), and `save_16bit_model` writes them whole (linear/engine.py). A
state dict loaded into the layer narrows a whole weight to the rank's shard; a shard of the right size is taken as it
is.
"""

from __future__ import annotations

import math
from dataclasses import is_dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.linear.config import LoRAConfig, QuantizationConfig
from zeroshard.linear.frozen import frozen_linear
from zeroshard.linear.quantization import QuantizedLinear, QuantizedParameter, load_quantized, requantized


class OptimizedLinear(nn.Module):
    """The layer a configuration asks for: `nn.Linear` (neither config), `QuantizedLinear` (quantization only) or
    `LoRAOptimizedLinear` (LoRA, with or without quantization), as DeepSpeed's constructor returns.

    Example:
        >>> type(OptimizedLinear(8, 4, lora_config=LoRAConfig(lora_r=2), dtype=torch.float32)).__name__
        'LoRAOptimizedLinear'
    """

    def __new__(  # type: ignore[misc]
        cls,
        input_dim: int,
        output_dim: int,
        bias: bool = False,
        lora_config: LoRAConfig | None = None,
        quantization_config: QuantizationConfig | None = None,
        device: Any = None,
        dtype: torch.dtype = torch.bfloat16,
        linear_cls: type[nn.Linear] = nn.Linear,
    ) -> nn.Module:
        if quantization_config is not None and not is_dataclass(quantization_config):
            raise ValueError(f"Expecting QuantizationConfig but received {type(quantization_config)}")
        if lora_config is not None and not is_dataclass(lora_config):
            raise ValueError(f"Expecting LoRAConfig but received {type(lora_config)}")
        if lora_config is not None:
            return LoRAOptimizedLinear(
                input_dim, output_dim, bias, lora_config, quantization_config, device, dtype, linear_cls
            )
        if quantization_config is not None:
            return QuantizedLinear(input_dim, output_dim, bias, quantization_config, dtype)
        return linear_cls(input_dim, output_dim, bias=bias, dtype=dtype, device=device)


class LoRAOptimizedLinear(nn.Module):
    """`base(x) + lora_alpha / lora_r * lora_weight_2(lora_weight_1(x))` over a frozen, possibly sharded
    ([Note: sharded base weights]) and quantized base weight; no bias. The adapters are built by `init_lora`
    (in the constructor unless `lora_config.delay_lora_init`).

    Example:
        >>> layer = LoRAOptimizedLinear(8, 4, lora_config=LoRAConfig(lora_r=2), dtype=torch.float32)
        >>> layer(torch.ones(3, 8)).shape, [n for n, p in layer.named_parameters() if p.requires_grad]
        (torch.Size([3, 4]), ['lora_weight_1.weight', 'lora_weight_2.weight'])
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        bias: bool = False,
        lora_config: LoRAConfig | None = None,
        quantization_config: QuantizationConfig | None = None,
        device: Any = None,
        dtype: torch.dtype = torch.bfloat16,
        linear_cls: type[nn.Linear] = nn.Linear,
    ):
        super().__init__()
        if lora_config is None:
            raise ValueError("LoRAOptimizedLinear needs a lora_config (deepspeed.linear.LoRAConfig)")
        if bias:
            raise ValueError("bias=True is not supported by LoRAOptimizedLinear")
        if not 0 <= lora_config.offload_ratio <= 1:
            raise ValueError(f"LoRAConfig offload_ratio={lora_config.offload_ratio} is not a share: give 0 to 1")
        if quantization_config is not None and dtype != torch.bfloat16:
            raise ValueError(f"LoRAOptimizedLinear with quantization supports dtype torch.bfloat16 only, not {dtype}")
        from zeroshard.accelerator import get_accelerator

        self.input_dim, self.output_dim = input_dim, output_dim
        self.register_parameter("bias", None)  # a module attribute Transformers' weight tying reads (not a bool)
        self.lora_config, self.quantization_config = lora_config, quantization_config
        self.device = get_accelerator().current_device_name() if device is None else device
        self.linear_cls, self.dtype = linear_cls, dtype
        self.zero_shards = int(lora_config.base_weight_sharding)
        _check_sharding(self.zero_shards, input_dim)
        self.sharded_weight_size = input_dim // self.zero_shards
        if self.zero_shards > 1:
            w = nn.Parameter(torch.empty(output_dim * self.sharded_weight_size, dtype=dtype), requires_grad=False)
        else:
            w = nn.Parameter(torch.empty((output_dim, input_dim), dtype=dtype), requires_grad=False)
        nn.init.xavier_uniform_(w.reshape(self.sharded_weight_size, output_dim))  # DeepSpeed's draw, shard-shaped
        self.weight: nn.Parameter = w
        if quantization_config is not None:
            self.weight = QuantizedParameter(w, quantization_config=quantization_config)
            self._quantizer = self.weight.quantizer
        self.disabled = False
        self._initialized = False
        if not lora_config.delay_lora_init:
            self.init_lora()

    def disable(self) -> None:
        """A plain linear layer from now on: a whole, unquantized base weight and no adapters (a module a loaded
        state dict names outside `target_mods`; adapters built already stay, unused, as DeepSpeed's)."""
        self.disabled = True
        whole = torch.empty((self.output_dim, self.input_dim), dtype=self.dtype, device=self.weight.device)
        self.weight = nn.Parameter(whole, requires_grad=False)

    def init_lora(self) -> None:
        """Build the adapters (A: Kaiming-uniform, B: zeros, as PEFT) and freeze the base weight."""
        if self.disabled:
            return
        self._ensure_quantized()
        self._initialized = True
        self.weight.requires_grad = False
        self.weight.ds_optim_param = True  # type: ignore[attr-defined]  # rank-local: never broadcast
        if self.lora_config.offload:
            self.weight.data = self.weight.data.to("cpu")
        self.lora_scaling_factor = self.lora_config.lora_alpha / self.lora_config.lora_r
        r, device = self.lora_config.lora_r, self.device
        self.lora_weight_1 = self.linear_cls(self.input_dim, r, bias=False, device=device, dtype=self.dtype)
        self.lora_weight_2 = self.linear_cls(r, self.output_dim, bias=False, device=device, dtype=self.dtype)
        nn.init.kaiming_uniform_(self.lora_weight_1.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_weight_2.weight)
        self.lora_weight_1.weight.requires_grad = True
        self.lora_weight_2.weight.requires_grad = True

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if not any(target in prefix for target in self.lora_config.target_mods):
            self.disable()
            return super()._load_from_state_dict(state_dict, prefix, *args)
        key = f"{prefix}weight"
        self._ensure_quantized()
        if self.zero_shards > 1 and key in state_dict:
            state_dict[key] = self._shard_of(state_dict[key], key)
        load_quantized(self.weight, state_dict, key)
        return super()._load_from_state_dict(state_dict, prefix, *args)

    def _ensure_quantized(self) -> None:
        """The base weight as a `QuantizedParameter` again where something replaced it by a plain parameter."""
        if self.quantization_config is not None and not isinstance(self.weight, QuantizedParameter):
            self.weight = requantized(self.weight, self.quantization_config, self._quantizer)

    def _shard_of(self, incoming: torch.Tensor, key: str) -> torch.Tensor:
        """This rank's part of a loaded base weight: a whole weight is narrowed, a shard taken as it is."""
        local = self.output_dim * self.sharded_weight_size
        if incoming.dtype == self.weight.dtype and incoming.shape == self.weight.shape:
            return incoming  # this layer's own (shard, or packed quantized shard)
        if incoming.numel() == local:
            return incoming.reshape(-1)  # a shard's values (quantized as it loads)
        if incoming.numel() == self.output_dim * self.input_dim:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError(
                    "attempting to use optimized linear base weight sharding but torch-distributed is not "
                    "initialized, please init first."
                )
            return incoming.flatten().narrow(0, dist.get_rank() * local, local)
        raise ValueError(
            f"{key}: {tuple(incoming.shape)} is neither the whole base weight ({self.output_dim}, {self.input_dim}) "
            f"nor one rank's shard of it ({local} elements)"
        )

    def _local_weight(self, device: torch.device) -> torch.Tensor:
        weight = self.weight.dequantized() if isinstance(self.weight, QuantizedParameter) else self.weight
        return weight.to(device, non_blocking=True) if weight.device != device else weight

    def full_weight(self, device: torch.device | None = None) -> torch.Tensor:
        """The whole base weight, `(output_dim, input_dim)`, in the layer's dtype (a collective when sharded)."""
        local = self._local_weight(self.weight.device if device is None else device)
        if self.zero_shards == 1:
            return local
        from zeroshard.comm import api

        whole = torch.empty(self.output_dim * self.input_dim, dtype=local.dtype, device=local.device)
        api.all_gather_into_tensor(whole, local.reshape(-1))
        return whole.view(self.output_dim, self.input_dim)

    def forward(self, input_tensor: torch.Tensor) -> torch.Tensor:
        if self.disabled:
            return F.linear(input_tensor, self.weight)
        if not self._initialized:
            raise RuntimeError("init_lora was never called, please initialize before proceeding")
        self._ensure_quantized()
        device = input_tensor.device
        if not self._reduced():
            base = F.linear(input_tensor, self.weight)
        elif self.lora_config.regather_in_backward:
            base = frozen_linear(input_tensor, lambda: self.full_weight(device))
        else:
            with torch.no_grad():
                whole = self.full_weight(device)
            base = F.linear(input_tensor, whole)
        lora = self.lora_weight_2(self.lora_weight_1(input_tensor))
        return base + self.lora_scaling_factor * lora

    def _reduced(self) -> bool:
        """Whether the base weight is held other than whole on the compute device: sharded, quantized, offloaded."""
        offloaded = self.lora_config.offload or getattr(self.weight, "ds_offload", False)
        return self.zero_shards > 1 or isinstance(self.weight, QuantizedParameter) or offloaded


def _check_sharding(shards: int, input_dim: int) -> None:
    if shards == 1:
        return
    import torch.distributed as dist

    if shards < 1:
        raise ValueError(f"LoRAConfig base_weight_sharding must be 1 or more, not {shards}")
    if not dist.is_initialized():
        raise RuntimeError(
            f"LoRAConfig base_weight_sharding={shards} needs torch.distributed initialized before the layer is built "
            "(deepspeed.init_distributed())"
        )
    if shards != dist.get_world_size():
        raise ValueError(
            f"LoRAConfig base_weight_sharding={shards} must equal the world size ({dist.get_world_size()}): the "
            "base weight is split over every rank"
        )
    if input_dim % shards:
        raise ValueError(
            f"LoRAConfig base_weight_sharding={shards} does not divide the layer's input_dim {input_dim}: each rank "
            "keeps input_dim / base_weight_sharding columns' worth of the weight"
        )
