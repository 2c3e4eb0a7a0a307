"""Tensor parallelism composed with ZeRO: the dp x tp mesh, Hugging Face split plans, the strategy, mpu support."""

from zeroshard.tp.build import autotp_size, build_tp
from zeroshard.tp.mesh import TensorParallelContext, TensorParallelGrid

__all__ = ["TensorParallelContext", "TensorParallelGrid", "autotp_size", "build_tp"]
