"""`deepspeed.linear.Init` and `init_lora`: build a model's linear layers as `OptimizedLinear` while it is constructed.

[Note: linear layers replaced while a model is built]
DeepSpeed's `Init` exists to never build the whole base weights: inside the block every `torch.nn.Linear(...)` a
model's code constructs is an `OptimizedLinear` with the block's configs (adapters delayed), so with
`base_weight_sharding` each rank allocates only its shard. That needs `torch.nn.Linear` itself to answer the model's
code, so the block rebinds it (and Transformers' `AutoModelForCausalLM.from_pretrained`/`from_config`, which then
call `init_lora` on the model they return: [Note: base weights from pretrained files]) and restores all of them when
the block ends, an exception included. This is the one place zeroshard rebinds a torch name: the API is defined by
it. Layers a loaded state dict names outside `target_mods` turn back into plain layers
(`LoRAOptimizedLinear.disable`).
"""

from __future__ import annotations

import importlib
from types import ModuleType, TracebackType
from typing import Any

import torch
from torch import nn

from zeroshard.linear.config import LoRAConfig, QuantizationConfig
from zeroshard.linear.optimized_linear import LoRAOptimizedLinear, OptimizedLinear
from zeroshard.linear.pretrained import from_pretrained as from_files
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


def _transformers() -> ModuleType | None:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        return None


def init_lora(model: nn.Module) -> None:
    """Freeze every parameter of `model`, then build the adapters of its `LoRAOptimizedLinear` layers (trainable).

    Example:
        >>> model = nn.Sequential(LoRAOptimizedLinear(8, 8, lora_config=LoRAConfig(lora_r=2, delay_lora_init=True),
        ...                                           dtype=torch.float32))
        >>> init_lora(model)
        >>> sum(p.numel() for p in model.parameters() if p.requires_grad)
        32
    """
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, LoRAOptimizedLinear):
            module.init_lora()


class Init:
    """[Note: linear layers replaced while a model is built].

    Example:
        >>> with Init(lora_config=LoRAConfig(lora_r=2)):
        ...     model = nn.Sequential(nn.Linear(8, 8, dtype=torch.float32))
        >>> init_lora(model)
        >>> type(model[0]).__name__
        'LoRAOptimizedLinear'
    """

    def __init__(self, lora_config: LoRAConfig | None = None, quant_config: QuantizationConfig | None = None):
        self.lora_config, self.quant_config = lora_config, quant_config
        self._orig_nn_linear = torch.nn.Linear
        self._post_init_complete = False
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Init:
        outer = self
        original = self._orig_nn_linear

        class OptLinearWrapper:
            _orig_nn_linear = original

            def __new__(cls, *args: Any, **kwargs: Any) -> nn.Module:  # type: ignore[misc]
                if outer.lora_config is not None:
                    outer.lora_config.delay_lora_init = True
                kwargs["lora_config"] = outer.lora_config
                kwargs["quantization_config"] = outer.quant_config
                kwargs["linear_cls"] = original
                return OptimizedLinear(*args, **kwargs)

        def finish(model: nn.Module) -> nn.Module:
            if outer.lora_config is not None:
                init_lora(model)
            outer._post_init_complete = True
            return model

        def finish_loaded(loaded: Any) -> Any:  # the model, or (model, loading info) with output_loading_info
            finish(loaded[0] if isinstance(loaded, tuple) else loaded)
            return loaded

        self._rebind(torch.nn, "Linear", OptLinearWrapper)
        transformers = _transformers()
        if transformers is not None:
            auto = transformers.AutoModelForCausalLM
            pretrained, from_config = auto.from_pretrained, auto.from_config
            self._rebind(auto, "from_pretrained", lambda *a, **k: finish_loaded(from_files(pretrained, a, k)))
            self._rebind(auto, "from_config", lambda *a, **k: finish(from_config(*a, **k)))
        return self

    def _rebind(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, value)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for owner, name, value in reversed(self._saved):
            if value is None:
                delattr(owner, name)  # an inherited classmethod: the class's own attribute goes again
            else:
                setattr(owner, name, value)
        self._saved.clear()
        if kind is None and not self._post_init_complete and self.lora_config is not None:
            logger.warning(
                "deepspeed.linear.Init: the LoRA adapters are built by AutoModelForCausalLM.from_pretrained/"
                "from_config inside the block; for a model built otherwise call init_lora(model) before training"
            )
