"""Where state lives: the compute device, host memory or NVMe, as objects that do the placing and the counting.

[Note: one interface]
`initialize` decides once where each kind of state lives and hands the strategies a `Tier` for it: one for
the fp32 master weights and optimizer state (`offload_optimizer`), one for stage 3's compute-dtype parameter
shards (`offload_param`). A tier allocates (`zeros`), keeps its tensors in or out of memory between uses
(`residency`: `InMemory`, or `NvmeStateStore` for NVMe, see offload/residency.py), answers the one placement
rule that depends on it (`shares_shard_with`: may a master and a compute shard be one tensor), hands out the
object that receives reduced gradients (`gradients()`, offload/gradients.py) and counts its own bytes into the
memory report. The stage code never asks which tier it holds.

[Note: partial offload]
`offload_optimizer.ratio` < 1 at stage 3 (DeepSpeed's ZeRO-Offload++ "Twin-Flow"): of the `count` sub-groups, those
with index >= int((1 - ratio) * count) keep their fp32 masters and optimizer state in host memory, stepped there by
the CPU; the others keep them on the compute device, stepped there. `PartialOffload` is the master tier the
strategy holds; each sub-group asks it for its own (`for_sub_group`), and the gradients follow that choice
(`SplitGradients`: host copies made during backward for the offloaded sub-groups, nothing extra for the others).
The device sub-groups come first, so on CUDA their update, and with offload_param its copy into the pinned host
shards (`publish_master`), is queued on the GPU before the host steps the others, and the two can overlap (not
with offload_param on NVMe: a shard is written out as soon as it is published, so that copy is waited for). The
split is by whole sub-groups, so `sub_group_size` sets its granularity: with one sub-group, any ratio > 0 offloads
all of it, as in DeepSpeed (rank 0 logs the split made: `log_split`). NVMe, and a ratio below stage 3, are refused
(config/checks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from zeroshard.memory import StrategyMemory
from zeroshard.offload.pinned import pinned_zeros
from zeroshard.offload.residency import InMemory, NvmeStateStore, Residency
from zeroshard.utils.logging import get_logger

if TYPE_CHECKING:
    from zeroshard.offload.gradients import GradientTier

logger = get_logger(__name__)


class Tier:
    """State on the compute device: allocated there, always resident, counted as device memory."""

    offloaded = False  # the memory report's "host_*" columns (and alias rules) follow this

    def __init__(self, device: torch.device, pin: bool = False):
        self.device = device
        self.pin = pin
        self._residency: Residency | None = None

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.pin and self.device.type == "cpu" and torch.cuda.is_available():
            return self._pinned(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def _pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Pinned host memory for state kept in memory for the run: exactly sized ([Note: pinned memory without
        rounding] in offload/pinned.py)."""
        return pinned_zeros(numel, dtype)

    @property
    def residency(self) -> Residency:
        """Whether this tier's tensors stay in memory between uses (built once, on first use)."""
        if self._residency is None:
            self._residency = self._make_residency()
        return self._residency

    def _make_residency(self) -> Residency:
        return InMemory()

    def may_alias_compute(self) -> bool:
        """Stages 0-2: whether an unsharded fp32 master may be the parameter buffer itself."""
        return not self.offloaded

    def shares_shard_with(self, param_tier: Tier) -> bool:
        """Stage 3, fp32 compute: whether the master (on this tier) and the compute shard (on `param_tier`) can be
        one tensor: they must sit on the same device, a master moved off the device never serves a shard that
        stays there, and a shard that leaves memory between uses (NVMe) only aliases a master that goes too."""
        same_device = self.device == param_tier.device
        return same_device and (param_tier.offloaded or not self.offloaded) and param_tier.aliases_from(self)

    def aliases_from(self, master_tier: Tier) -> bool:
        return True

    def for_sub_group(self, index: int, count: int) -> Tier:
        """Where stage 3's sub-group `index` (of `count`) keeps its masters and optimizer state: here, unless this
        tier splits them ([Note: partial offload])."""
        return self

    def log_split(self, sub_groups: list[tuple[Tier, int]]) -> None:
        """Say how the sub-groups (each's tier and shard elements) were split: nothing to say unless this tier
        splits them."""

    def gradients(self, copy_stream: torch.cuda.Stream | None, check_overflow: bool) -> GradientTier:
        """Where reduced gradients wait for the optimizer when the master lives here."""
        from zeroshard.offload.gradients import StepTimeCopies

        return StepTimeCopies(self, copy_stream, check_overflow)

    # -- byte accounting ---------------------------------------------------------------------------------
    def count_state(self, memory: StrategyMemory, masters: int, state: int, unswapped: int = 0) -> None:
        """Master weights and optimizer state held on this tier (`unswapped`: the part of `state` that stays in memory
        where the rest swaps, Muon's momentum with save_muon_momentum_buffer_in_memory; only NVMe tells it apart)."""
        memory.master_weights += masters
        memory.optimizer_state += state

    def count_params(self, memory: StrategyMemory, shards: int) -> None:
        """Compute-dtype parameter shards (stage 3) held on this tier."""
        memory.params += shards

    def count_grad_copies(self, memory: StrategyMemory, copies: int) -> None:
        """fp32 gradient copies the optimizer reads, kept on this tier."""
        memory.comm_buffers += copies


class HostTier(Tier):
    """State in host memory (pinned on CUDA machines), counted in the report's host columns."""

    offloaded = True

    def __init__(self, pin: bool = False):
        super().__init__(torch.device("cpu"), pin)

    def gradients(self, copy_stream: torch.cuda.Stream | None, check_overflow: bool) -> GradientTier:
        from zeroshard.offload.gradients import BackwardCopies

        return BackwardCopies(self, copy_stream, check_overflow)

    def count_state(self, memory: StrategyMemory, masters: int, state: int, unswapped: int = 0) -> None:
        memory.host_master_weights += masters
        memory.host_optimizer_state += state

    def count_params(self, memory: StrategyMemory, shards: int) -> None:
        memory.host_params += shards

    def count_grad_copies(self, memory: StrategyMemory, copies: int) -> None:
        memory.host_gradients += copies


class NvmeTier(HostTier):
    """State in swap files between uses, read into host memory for each use (ZeRO-Infinity)."""

    def __init__(self, store_factory: Callable[[], NvmeStateStore], pin: bool = False):
        super().__init__(pin)
        self._store_factory = store_factory

    def _make_residency(self) -> Residency:
        return self._store_factory()

    def _pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # freed and re-allocated (resized) around every use: torch's allocator, whose cache reuses the blocks
        return torch.zeros(numel, dtype=dtype, pin_memory=True)

    def aliases_from(self, master_tier: Tier) -> bool:
        return isinstance(master_tier, NvmeTier)

    def gradients(self, copy_stream: torch.cuda.Stream | None, check_overflow: bool) -> GradientTier:
        from zeroshard.offload.gradients import SwappedGradients

        return SwappedGradients(self, copy_stream, check_overflow)

    def count_state(self, memory: StrategyMemory, masters: int, state: int, unswapped: int = 0) -> None:
        # what is resident now (read in for a step), masters and state together, and the state that never swaps;
        # the rest is in the swap files
        memory.host_optimizer_state += self.residency.resident_bytes + unswapped
        memory.nvme_bytes += self.residency.disk_bytes

    def count_params(self, memory: StrategyMemory, shards: int) -> None:
        memory.host_params += shards
        memory.nvme_bytes += self.residency.disk_bytes


class PartialOffload(Tier):
    """Masters and optimizer state split by sub-group between the compute device and host memory ([Note: partial
    offload]); the sub-groups' own tiers do the placing and the counting."""

    def __init__(self, device_tier: Tier, host_tier: HostTier, ratio: float):
        super().__init__(device_tier.device)
        self.device_tier = device_tier
        self.host_tier = host_tier
        self.ratio = ratio

    def for_sub_group(self, index: int, count: int) -> Tier:
        return self.host_tier if index >= int((1.0 - self.ratio) * count) else self.device_tier

    def log_split(self, sub_groups: list[tuple[Tier, int]]) -> None:
        host = [numel for tier, numel in sub_groups if tier is self.host_tier]
        logger.info(
            "stage 3, offload_optimizer.ratio %s: %d of %d sub-groups (%.0f%% of this rank's shard elements) keep "
            "their optimizer state in host memory, the others on %s (sub_group_size sets the granularity)",
            self.ratio,
            len(host),
            len(sub_groups),
            100.0 * sum(host) / max(sum(numel for _, numel in sub_groups), 1),
            self.device,
        )

    def gradients(self, copy_stream: torch.cuda.Stream | None, check_overflow: bool) -> GradientTier:
        from zeroshard.offload.gradients import SplitGradients

        device = self.device_tier.gradients(copy_stream, check_overflow)
        host = self.host_tier.gradients(copy_stream, check_overflow)
        return SplitGradients(self, device, host)

    def count_state(self, memory: StrategyMemory, masters: int, state: int, unswapped: int = 0) -> None:
        raise AssertionError("partial offload: each sub-group's tier counts its own state")

    def count_params(self, memory: StrategyMemory, shards: int) -> None:
        raise AssertionError("partial offload splits optimizer state, not parameter shards")


def tier_for(
    kind: str,
    compute_device: torch.device,
    pin_memory: bool,
    store_factory: Callable[[], NvmeStateStore] | None = None,
    ratio: float = 1.0,
) -> Tier:
    """`kind` is the config's offload device ("none", "cpu" or "nvme"; "nvme" needs `store_factory`); `ratio` < 1
    (host memory only, stage 3) offloads that fraction of the sub-groups ([Note: partial offload])."""
    if kind in ("none", "", None):
        return Tier(compute_device)
    if kind == "nvme":
        assert store_factory is not None, "an NVMe tier needs its store"
        return NvmeTier(store_factory, pin_memory)
    if ratio < 1.0:
        return PartialOffload(Tier(compute_device), HostTier(pin_memory), ratio)
    return HostTier(pin_memory)
