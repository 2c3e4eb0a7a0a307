"""Bytes a strategy holds on one rank, by kind: what `engine.memory_report()` reports."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class StrategyMemory:
    """Filled by a strategy and the tiers it holds (each tier counts its own bytes in the right column)."""

    params: int = 0  # compute-dtype parameters (stage 3: this rank's shards) on the device
    gradients: int = 0
    master_weights: int = 0
    optimizer_state: int = 0
    comm_buffers: int = 0
    persistent_params: int = 0  # stage 3: small parameters kept whole on every rank
    gathered_params: int = 0  # stage 3: full units gathered right now
    peak_gathered_params: int = 0  # stage 3: largest gathered working set so far
    host_params: int = 0  # offload_param: compute-dtype shards in host memory
    host_master_weights: int = 0  # offload_optimizer: fp32 master weights in host memory
    host_optimizer_state: int = 0  # offload_optimizer: optimizer state in host memory
    host_gradients: int = 0  # offload_optimizer: fp32 gradient copies in host memory
    nvme_bytes: int = 0  # NVMe offload: bytes in swap files

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
