"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: the sequence-parallel mpu Hugging Face's Ulysses
integration passes to `initialize(mpu=...)` ([Note: sequence parallelism] in sequence/mesh.py).

`initialize_sequence_parallel(P)` makes consecutive groups of P ranks; the sequence-data-parallel group is the
whole world (ZeRO's). The module itself is the mpu, as in DeepSpeed: its model-parallel names answer for the
sequence-parallel group. The groups live in one holder per process, as torch's own default group does.

Example:
    >>> from zeroshard.runtime.sequence_parallel import parallel_state_sp
    >>> parallel_state_sp.initialize_sequence_parallel(2)  # doctest: +SKIP
    >>> engine, *_ = zeroshard.initialize(model=model, config=cfg, mpu=parallel_state_sp)  # doctest: +SKIP
"""

from __future__ import annotations

import torch.distributed as dist

from zeroshard.comm.topology import new_group


class _Groups:
    def __init__(self) -> None:
        self.sequence: dist.ProcessGroup | None = None
        self.sequence_data: dist.ProcessGroup | None = None
        self.made = False


_GROUPS = _Groups()


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Make the groups: ranks [k*P, (k+1)*P) split one sample's sequence; every rank shards ZeRO state."""
    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: call torch.distributed.init_process_group first")
    world = dist.get_world_size()
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world % sequence_parallel_size:
        raise RuntimeError(f"world_size ({world}) is not divisible by sequence_parallel_size {sequence_parallel_size}")
    if _GROUPS.made:
        raise RuntimeError("sequence parallel group is already initialized")
    rank = dist.get_rank()
    for start in range(0, world, sequence_parallel_size):
        ranks = list(range(start, start + sequence_parallel_size))
        group = dist.group.WORLD if sequence_parallel_size == world else new_group(ranks)
        if rank in ranks:
            _GROUPS.sequence = group
    _GROUPS.sequence_data = dist.group.WORLD
    _GROUPS.made = True


def _release_sequence_parallel_groups() -> None:
    """Forget the groups (after the world is destroyed)."""
    _GROUPS.sequence = _GROUPS.sequence_data = None
    _GROUPS.made = False


def get_sequence_parallel_group() -> dist.ProcessGroup | None:
    if not _GROUPS.made:
        raise RuntimeError("sequence parallel group is not initialized")
    return _GROUPS.sequence


def get_sequence_data_parallel_group() -> dist.ProcessGroup | None:
    if not _GROUPS.made:
        raise RuntimeError("sequence data parallel group is not initialized")
    return _GROUPS.sequence_data


def get_sequence_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(group=get_sequence_data_parallel_group())


# DeepSpeed's aliases: the model-parallel names answer for the sequence-parallel group
get_model_parallel_rank = get_sequence_parallel_rank
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_group = get_sequence_parallel_group
