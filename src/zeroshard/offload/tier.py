"""Where fp32 master weights and optimizer state live: the compute device, host memory or NVMe.

[Note: one interface]
The stage code allocates master shards and gradient copies through a `Tier` and never asks which tier
it is: `Tier.device` is where the tensors sit while the optimizer works on them (the compute device, or
the CPU for both offload tiers), `Tier.pin` says whether host tensors are page-locked for asynchronous
copies. Whether the tensors stay in memory between uses is the business of a residency object
(`offload/nvme_store.py`: `InMemory`, or `NvmeStateStore` for the NVMe tier), equally tier-blind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tier:
    kind: str  # "device" | "cpu" | "nvme"
    device: torch.device
    pin: bool = False

    @property
    def offloaded(self) -> bool:
        return self.kind != "device"

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        pin = self.pin and self.device.type == "cpu" and torch.cuda.is_available()
        return torch.zeros(numel, dtype=dtype, device=self.device, pin_memory=pin)

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device


def tier_for(kind: str, compute_device: torch.device, pin_memory: bool) -> Tier:
    """`kind` is the config's offload device: "none" keeps state on the compute device."""
    if kind in ("none", "", None):
        return Tier("device", compute_device)
    return Tier(kind, torch.device("cpu"), pin=pin_memory)


def copy_aside(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    """dst := src; on CUDA (a `stream` given) asynchronously on that side stream, after the work already queued
    on the current stream (`stream.synchronize()` before reading `dst` on the host)."""
    if stream is None:
        dst.copy_(src)
        return
    stream.wait_stream(torch.cuda.current_stream(src.device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
