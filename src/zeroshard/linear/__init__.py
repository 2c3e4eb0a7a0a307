"""`deepspeed.linear`: `OptimizedLinear` (LoRA over a frozen base weight, sharded over the ranks and quantized),
its configs, and `Init`/`init_lora` to build a model's linear layers that way.
"""

from zeroshard.linear.config import LoRAConfig, QuantizationConfig
from zeroshard.linear.context_manager import Init, init_lora
from zeroshard.linear.optimized_linear import LoRAOptimizedLinear, OptimizedLinear
from zeroshard.linear.quantization import QuantizedLinear, QuantizedParameter

__all__ = [
    "Init",
    "LoRAConfig",
    "LoRAOptimizedLinear",
    "OptimizedLinear",
    "QuantizationConfig",
    "QuantizedLinear",
    "QuantizedParameter",
    "init_lora",
]
