"""Storage tiers for offloaded state. NVMe: `NvmeSwapper` (asynchronous tensor swap files) and `preflight`."""

from zeroshard.offload.aio import IoMode
from zeroshard.offload.buffers import aligned_zeros
from zeroshard.offload.nvme import AioSettings, NvmeSwapError, NvmeSwapper, SwapHandle
from zeroshard.offload.preflight import preflight

__all__ = ["AioSettings", "IoMode", "aligned_zeros", "NvmeSwapError", "NvmeSwapper", "SwapHandle", "preflight"]
