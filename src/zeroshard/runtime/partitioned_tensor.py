"""`deepspeed.runtime.utils.PartitionedTensor`: a tensor cut flat into one contiguous part per rank of a group,
which pipeline scripts use to send activations in parts and rebuild them (`to_meta` / `from_meta`)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.accelerator import get_accelerator
from zeroshard.comm import api as comm
from zeroshard.pipe.partition import partition_uniform


class PartitionedTensor:
    """This rank's part of `tensor`: the flat elements `partition[rank]:partition[rank + 1]`, where `partition`
    is `partition_uniform(numel, world)` (DeepSpeed's cut: equal parts, the remainder spread one element each over
    the first). `full()` gathers the tensor back (a collective over `group`).

    Example:
        >>> part = PartitionedTensor(torch.arange(6.0).view(2, 3), group=None)  # doctest: +SKIP
        >>> part.full().shape  # doctest: +SKIP
        torch.Size([2, 3])
    """

    def __init__(self, tensor: torch.Tensor, group: Any, partition_meta: Any = None) -> None:
        self.group = group
        self.num_parts = comm.get_world_size(group=group)
        self.rank = comm.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device: torch.device | str = tensor.device
        self.partition = partition_uniform(num_items=tensor.numel(), num_parts=self.num_parts)
        start, end = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().contiguous().view(-1)[start:end].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(
        cls, meta: torch.Tensor, local_part: torch.Tensor, group: Any, device: Any = None
    ) -> PartitionedTensor:
        """The `PartitionedTensor` that `to_meta()` described, over `local_part` (this rank's part)."""
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta must be a LongTensor from to_meta(), got {meta.dtype}")
        values = [int(v) for v in meta.tolist()]
        ndim = values[0]
        orig_size, rest = values[1 : 1 + ndim], values[1 + ndim :]
        part = cls.__new__(cls)
        part.group = group
        part.num_parts = comm.get_world_size(group=group)
        part.rank = comm.get_rank(group=group)
        if rest[0] != part.num_parts or rest[1] != part.rank:
            raise ValueError(
                f"PartitionedTensor.from_meta: the meta was made by rank {rest[1]} of {rest[0]} parts, this is rank "
                f"{part.rank} of a group of {part.num_parts}"
            )
        part.orig_size = orig_size
        part.orig_device = device if device is not None else get_accelerator().current_device_name()
        part.local_data = local_part.detach()
        part.partition = rest[2:]
        part.even_split = math.prod(orig_size) % part.num_parts == 0
        return part

    def full(self, device: Any = None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's part (each rank must call it)."""
        flat = torch.zeros(math.prod(self.orig_size), dtype=self.local_data.dtype, device=device or self.orig_device)
        if self.even_split:
            comm.all_gather_into_tensor(flat, self.local_data.to(flat.device), group=self.group)
        else:  # uneven parts: each rank broadcasts its own (gloo has no uneven all-gather)
            for part_id in range(self.num_parts):
                start, end = self.partition[part_id], self.partition[part_id + 1]
                piece = flat[start:end]
                if part_id == self.rank:
                    piece.copy_(self.local_data)
                src = dist.get_global_rank(self.group, part_id) if self.group is not None else part_id
                comm.broadcast(piece, src, group=self.group)
        return flat.view(self.orig_size)

    def to_meta(self) -> torch.Tensor:
        """A LongTensor `[ndim, *size, num_parts, rank, *partition]` that `from_meta` reads back."""
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size


__all__ = ["PartitionedTensor"]
