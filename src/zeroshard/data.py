"""The training dataloader `initialize` builds when it is given `training_data`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset


def build_dataloader(
    dataset: Dataset[Any],
    micro_batch_size: int,
    rank: int,
    world_size: int,
    collate_fn: Callable[..., Any] | None = None,
    drop_last: bool = False,
    seed: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader[Any]:
    """Each rank reads its own 1/world_size of every epoch, `micro_batch_size` samples at a time
    (a shuffling DistributedSampler, as DeepSpeed's dataloader has). The sampler's position is saved in
    checkpoints, and the loader draws from its own generator, not the global torch RNG, so a resumed run
    continues with the same batches and the same dropout as an uninterrupted one."""
    import torch

    from zeroshard.checkpoint.sampler import ResumableDistributedSampler

    sampler = ResumableDistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
    )
    return DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed),
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


def stdlib_corpus(max_bytes: int = 2_000_000) -> bytes:
    """A default text corpus that needs no download: the Python standard library's own source files,
    in a fixed (sorted) order so every machine and rank reads the same bytes."""
    import os
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in {"test", "tests", "site-packages", "idlelib"})
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as fh:
                    data = fh.read()
                chunks.append(data)
                total += len(data)
                if total >= max_bytes:
                    return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


class ByteBlocks(Dataset[tuple[Any, Any]]):
    """Byte-level language-model samples: (x, y) blocks of `block_size` tokens, y shifted by one."""

    def __init__(self, data: bytes, block_size: int):
        import torch

        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.block_size = block_size
        if len(self.tokens) <= block_size:
            raise ValueError(f"corpus of {len(self.tokens)} bytes is shorter than block_size {block_size}")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]
