"""What `engine.memory_report()` reports: bytes a strategy holds on one rank, by kind, and the process's memory as
the operating system (and on CUDA the caching allocator) counts it."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


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
    secondary_params: int = 0  # stage 3 with ZeRO++ hpZ: this rank's secondary (node-local) parameter shards
    host_params: int = 0  # offload_param: compute-dtype shards in host memory
    host_master_weights: int = 0  # offload_optimizer: fp32 master weights in host memory
    host_optimizer_state: int = 0  # offload_optimizer: optimizer state in host memory
    host_gradients: int = 0  # offload_optimizer: fp32 gradient copies in host memory
    nvme_bytes: int = 0  # NVMe offload: bytes in swap files

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class ProcessMemory:
    """What the process holds as the operating system and the device allocator count it, next to the strategy's
    own accounting: a gap between the two is memory the formulas do not describe (activations, allocator caches,
    fragmentation; [Note: glibc's mmap threshold])."""

    process_rss: int = 0  # VmRSS: resident set now (Linux /proc/self/status; 0 elsewhere)
    process_peak_rss: int = 0  # VmHWM: the resident set's high-water mark since the process started
    device_allocated: int = 0  # CUDA: torch.cuda.memory_allocated (0 on the CPU)
    device_peak_allocated: int = 0  # CUDA: torch.cuda.max_memory_allocated since start or the last reset


def process_memory(device: torch.device) -> ProcessMemory:
    """This process's resident set and peak (Linux), and on CUDA the caching allocator's allocated bytes and peak."""
    status = _proc_status(("VmRSS", "VmHWM"))
    out = ProcessMemory(process_rss=status.get("VmRSS", 0), process_peak_rss=status.get("VmHWM", 0))
    if device.type == "cuda" and torch.cuda.is_available():
        out.device_allocated = torch.cuda.memory_allocated(device)
        out.device_peak_allocated = torch.cuda.max_memory_allocated(device)
    return out


def _proc_status(names: tuple[str, ...]) -> dict[str, int]:
    """Fields of /proc/self/status in bytes ({} where there is no /proc)."""
    out = {}
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key in names:
                    out[key] = int(value.split()[0]) * 1024  # "kB"
    except (OSError, ValueError, IndexError):
        return {}
    return out
