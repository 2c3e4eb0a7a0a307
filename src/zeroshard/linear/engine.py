"""What the engine does about `LoRAOptimizedLinear` layers ([Note: sharded base weights] in optimized_linear.py):
where their rank-local base-weight shards cannot go, their `offload_ratio`, checkpoints without them, and their whole
weights for a 16-bit model file."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroshard.errors import ConfigError
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

if TYPE_CHECKING:
    from zeroshard.linear.optimized_linear import LoRAOptimizedLinear


def _layers(model: nn.Module) -> list[tuple[str, LoRAOptimizedLinear]]:
    """The model's `LoRAOptimizedLinear` layers in use (none unless `zeroshard.linear` was imported)."""
    if "zeroshard.linear.optimized_linear" not in sys.modules:
        return []
    from zeroshard.linear.optimized_linear import LoRAOptimizedLinear

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRAOptimizedLinear) and not m.disabled]


def sharded_layers(model: nn.Module) -> list[tuple[str, LoRAOptimizedLinear]]:
    """The layers whose base weight is a rank-local shard (`base_weight_sharding` > 1)."""
    return [(n, m) for n, m in _layers(model) if m.zero_shards > 1]


def refuse_sharded_base_weights(model: nn.Module, stage: int, backend: str) -> None:
    """Before any work: ZeRO stage 3 and the fsdp2 backend shard every parameter, a rank-local shard included, and
    gather a parameter in the compute dtype, which quantized bytes are not."""
    if stage != 3 and backend != "fsdp2":
        return
    where = "the fsdp2 backend" if backend == "fsdp2" else "ZeRO stage 3"
    layers = sharded_layers(model)
    if layers:
        name, layer = layers[0]
        raise ConfigError(
            f"{name or 'the model'}: a LoRAOptimizedLinear with base_weight_sharding={layer.zero_shards} keeps its "
            f"rank's shard of the base weight, which {where} would shard again ({len(layers)} such layers); use "
            "base_weight_sharding=1 there (it shards the frozen base weights itself) or ZeRO stage 0-2"
        )
    offloaded = [n for n, m in _layers(model) if m.lora_config.offload or m.lora_config.offload_ratio]
    if offloaded:
        raise ConfigError(
            f"{offloaded[0]}: LoRAConfig offload / offload_ratio moves base weights to the CPU, which {where} "
            'manages itself; use "zero_optimization": {"offload_param": {"device": "cpu"}} there, or ZeRO stage 0-2'
        )
    if "zeroshard.linear.quantization" not in sys.modules:
        return
    from zeroshard.linear.quantization import QuantizedParameter

    quantized = [n for n, p in model.named_parameters() if isinstance(p, QuantizedParameter)]
    if quantized:
        raise ConfigError(
            f"{quantized[0]}: a deepspeed.linear QuantizedParameter ({len(quantized)} in the model) holds fp8 bytes, "
            f"which {where} cannot shard and gather as weights; use ZeRO stage 0-2, or at stage 3 no "
            'quantization_config and "zero_optimization": {"zero_quantized_nontrainable_weights": true} '
            "(stage 3's own 8-bit frozen weights)"
        )


def offload_base_weights(model: nn.Module) -> None:
    """`LoRAConfig.offload_ratio`, as DeepSpeed's engine applies it once the model is on its device: that share of the
    base-weight elements (the `ds_optim_param` parameters, the first in the model's order first) moves to the CPU
    (pinned where CUDA is at hand) and is marked `ds_offload`; the layers copy it to the input's device for each use."""
    layers = _layers(model)
    ratios = sorted({float(m.lora_config.offload_ratio) for _, m in layers})
    if len(ratios) > 1:
        raise ConfigError(
            f"LoRAConfig offload_ratio differs between the model's LoRAOptimizedLinear layers ({ratios}); give every "
            "layer the same ratio (it is a share of the whole model's base weights)"
        )
    if not ratios or ratios[0] == 0:
        return
    params = [p for p in model.parameters() if getattr(p, "ds_optim_param", False)]
    limit, moved = sum(p.numel() for p in params) * ratios[0], 0
    for param in params:
        param.ds_offload = moved < limit  # type: ignore[attr-defined]
        if param.ds_offload:  # type: ignore[attr-defined]
            moved += param.numel()
            host = param.data.to("cpu")
            param.data = host.pin_memory() if torch.cuda.is_available() else host
    log_rank(logger, logging.INFO, f"LoRAConfig offload_ratio {ratios[0]}: {moved} base-weight elements on the CPU")


def checkpoint_excludes_frozen(model: nn.Module, exclude_frozen_parameters: bool) -> bool:
    """A checkpoint writes a replicated parameter once, from one rank: a rank-local shard would come back as that
    rank's on every rank. With such layers the checkpoint leaves out the frozen parameters (they come from the
    pretrained files, as the base weights do), as `exclude_frozen_parameters=True` does, saying so once; a script
    that does not pass the flag (Transformers' Trainer saves a non-PEFT model without it) still saves and resumes."""
    layers = sharded_layers(model)
    if layers and not exclude_frozen_parameters:
        log_rank(
            logger,
            logging.WARNING,
            f"save_checkpoint: {len(layers)} LoRAOptimizedLinear layers ({layers[0][0]}, ...) keep rank-local shards "
            "of their frozen base weights, which a checkpoint cannot write as one tensor: the frozen parameters are "
            "left out (exclude_frozen_parameters=True); they come from the pretrained model when the run resumes",
        )
    return exclude_frozen_parameters or bool(layers)


def whole_base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole base weights of the sharded or quantized layers, by state-dict key, on the CPU, in the layer's dtype
    (collective: every rank calls it). What a 16-bit model file holds, loadable into the layers again."""
    whole = {}
    for name, layer in _layers(model):
        if layer.zero_shards > 1 or layer.weight.dtype != layer.dtype:
            with torch.no_grad():
                whole[f"{name}.weight" if name else "weight"] = layer.full_weight().cpu()
    return whole
