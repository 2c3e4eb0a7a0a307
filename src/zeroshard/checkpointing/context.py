"""The one object that holds what `configure` set: settings, the model-parallel group, buffers and counters.

[Note: one checkpointing context] DeepSpeed's `deepspeed.checkpointing` is a set of module functions
(`configure`, then `checkpoint` anywhere in the model) over module globals. We keep its API, so its state has to
be reachable from those functions; it lives in one `CheckpointingContext` object (`CONTEXT`) instead of a dozen
globals, and `configure`/`reset` replace or clear that object's fields in one place.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroshard.checkpointing.rng import CudaRNGStatesTracker
from zeroshard.checkpointing.settings import CheckpointingSettings
from zeroshard.errors import ZeroshardError


@dataclass
class ModelParallel:
    """The group a checkpointed input is partitioned over ([Note: what is partitioned])."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @classmethod
    def of(cls, mpu: Any) -> ModelParallel:
        """From a Megatron-style mpu (tensor-model-parallel getters preferred, as DeepSpeed); None: no partition."""
        if mpu is None:
            return cls()
        if hasattr(mpu, "get_tensor_model_parallel_rank"):
            return cls(
                mpu.get_tensor_model_parallel_rank(),
                mpu.get_tensor_model_parallel_world_size(),
                mpu.get_tensor_model_parallel_group(),
            )
        return cls(mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(), mpu.get_model_parallel_group())


_ALLOCATIONS = itertools.count()  # numbers each allocation of pieces, so a piece of an older one is not given back


@dataclass
class ContiguousBuffers:
    """contiguous_memory_optimization: for the i-th checkpointed input of a function, `number_checkpoints`
    preallocated pieces.

    [Note: contiguous pieces are taken and given back] A checkpoint's forward takes a free piece and its input is
    held there until it has been restored in backward (or the checkpoint's graph is freed without one): the Kept
    input gives its piece back when it dies. Handing them out in a circle and starting over at each backward, as
    before, let a checkpoint past `number_checkpoints` or a pipeline's later micro-batch (1F1B keeps several forwards
    alive) overwrite an input still to be recomputed: wrong gradients, without an error. With every piece held the
    next take is refused in one line naming number_checkpoints (DeepSpeed fails there too, indexing past its
    buffer)."""

    pieces: list[list[torch.Tensor]] = field(default_factory=list)
    free: list[list[int]] = field(default_factory=list)
    allocation: list[int] = field(default_factory=list)

    def take(self, position: int, like: torch.Tensor, count: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        """A free piece holding `like`'s values, and the token that gives it back (`give_back(*token)`)."""
        while len(self.pieces) <= position:
            self.pieces.append([])
            self.free.append([])
            self.allocation.append(-1)
        slots = self.pieces[position]
        if not slots or slots[0].numel() != like.numel() or slots[0].dtype != like.dtype:
            # another size: new pieces (inputs held in the old ones keep those alive until they are restored)
            slots[:] = [torch.empty(like.numel(), dtype=like.dtype, device=device) for _ in range(count)]
            self.free[position] = list(range(count))
            self.allocation[position] = next(_ALLOCATIONS)
        if not self.free[position]:
            raise ZeroshardError(
                f"activation_checkpointing.number_checkpoints is {count}, and {count} checkpointed inputs are held "
                "already (each until its backward: a forward checkpointing more layers, or a pipeline's micro-batches "
                "in flight, hold more); raise number_checkpoints or turn contiguous_memory_optimization off"
            )
        index = self.free[position].pop(0)
        return slots[index].copy_(like.reshape(-1)), (position, index, self.allocation[position])

    def give_back(self, position: int, index: int, allocation: int) -> None:
        if position < len(self.allocation) and self.allocation[position] == allocation:
            bisect.insort(self.free[position], index)

    def release(self) -> None:
        self.pieces.clear()
        self.free.clear()
        self.allocation.clear()


@dataclass
class CheckpointStats:
    """Counters a test or a profile reads: bytes of checkpointed inputs kept now and at most, on the compute
    device and in host memory (cpu_checkpointing), and with `profile` the time of each phase."""

    device_bytes: int = 0
    host_bytes: int = 0
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    calls: int = 0

    def keep(self, nbytes: int, on_host: bool) -> None:
        if on_host:
            self.host_bytes += nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        else:
            self.device_bytes += nbytes
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def drop(self, nbytes: int, on_host: bool) -> None:
        if on_host:
            self.host_bytes -= nbytes
        else:
            self.device_bytes -= nbytes


@dataclass
class CheckpointingContext:
    settings: CheckpointingSettings = field(default_factory=CheckpointingSettings)
    model_parallel: ModelParallel = field(default_factory=ModelParallel)
    mpu: Any = None
    configured: bool = False
    buffers: ContiguousBuffers = field(default_factory=ContiguousBuffers)
    stats: CheckpointStats = field(default_factory=CheckpointStats)
    side_streams: dict[torch.device, Any] = field(default_factory=dict)
    rng_tracker: CudaRNGStatesTracker = field(default_factory=CudaRNGStatesTracker)

    def side_stream(self, device: torch.device) -> Any:
        """cpu_checkpointing on CUDA: the stream the host copies run on, one per device."""
        if device not in self.side_streams:
            self.side_streams[device] = torch.cuda.Stream(device=device)
        return self.side_streams[device]


CONTEXT = CheckpointingContext()
