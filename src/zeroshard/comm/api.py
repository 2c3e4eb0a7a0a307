"""`deepspeed.comm`'s torch.distributed-style functions, for the user's own collectives.

[Note: user collectives] `collectives.py` is the one place the strategies call torch.distributed, so their
bytes are counted and their order fingerprinted. The functions here are for the training script's own
calls (averaging a loss for logging, a barrier before saving), as DeepSpeed scripts make them through
`deepspeed.comm`; they call torch.distributed directly and are not counted in `engine.comm_stats`. Their tensors
are followed to exit like the engine's (`USER_IN_FLIGHT`, [Note: nothing held by a collective at exit]): a script's
last `all_reduce` of its loss is as likely as the engine's last gather to be dropped by a backend worker while the
interpreter finalizes.
DeepSpeed's profiling keywords (`prof`, `log_name`, `debug`) are accepted and ignored: the `comms_logger` block
logs the engine's collectives (`engine.comms_logger`, `log_summary()` here), not these.
"""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from zeroshard.comm import topology
from zeroshard.comm.collectives import all_gather_single
from zeroshard.comm.comms_logger import LIVE
from zeroshard.comm.in_flight import InFlight
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])
_PROFILING_KEYWORDS = ("prof", "log_name", "debug")
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # DeepSpeed's constant, which scripts pass as distributed_port


# one per process, as torch.distributed's own default group: these functions name no engine
USER_IN_FLIGHT = InFlight()


def _user_collective(fn: _F) -> _F:
    """torch.distributed's `fn`, accepting DeepSpeed's profiling keywords (see [Note: user collectives])."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        for name in _PROFILING_KEYWORDS:
            kwargs.pop(name, None)
        return USER_IN_FLIGHT.issue(_tensors_in([*args, *kwargs.values()]), lambda: fn(*args, **kwargs))

    return call  # type: ignore[return-value]


def _tensors_in(values: list[Any]) -> list[torch.Tensor]:
    """The tensors among a collective's arguments, and in its tensor lists (all_gather's output, scatter's input)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


all_reduce = _user_collective(dist.all_reduce)
broadcast = _user_collective(dist.broadcast)
all_gather = _user_collective(dist.all_gather)
all_gather_into_tensor = _user_collective(all_gather_single)  # (torch 2.13 deprecates the old name: no warning)
reduce = _user_collective(dist.reduce)
reduce_scatter = _user_collective(dist.reduce_scatter)
reduce_scatter_tensor = _user_collective(dist.reduce_scatter_tensor)
all_to_all_single = _user_collective(dist.all_to_all_single)
all_to_all = _user_collective(dist.all_to_all)
all_reduce_coalesced = _user_collective(dist.all_reduce_coalesced)
gather = _user_collective(dist.gather)
scatter = _user_collective(dist.scatter)
send = _user_collective(dist.send)
recv = _user_collective(dist.recv)
isend = _user_collective(dist.isend)
irecv = _user_collective(dist.irecv)
barrier = _user_collective(dist.barrier)
monitored_barrier = _user_collective(dist.monitored_barrier)
broadcast_object_list = dist.broadcast_object_list
all_gather_object = dist.all_gather_object
new_group = dist.new_group
is_available = dist.is_available
is_initialized = dist.is_initialized
destroy_process_group = dist.destroy_process_group


class P2POp:
    """DeepSpeed's point-to-point operation for `batch_isend_irecv`: `op` is this module's `isend` or `irecv`.

    Example:
        >>> P2POp(isend, torch.zeros(1), peer=1).op
        'isend'
    """

    def __init__(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int, group: Any = None, tag: int = 0):
        if op not in (isend, irecv):
            raise ValueError("P2POp: op must be zeroshard.comm.isend or zeroshard.comm.irecv (deepspeed.comm's)")
        self.op = "isend" if op is isend else "irecv"
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list: list[P2POp], **_: Any) -> list[Any]:
    """The operations as one batch (torch's `batch_isend_irecv`); their requests, to wait on."""
    ops = [dist.P2POp(getattr(dist, op.op), op.tensor, op.peer, op.group, op.tag) for op in p2p_op_list]
    return USER_IN_FLIGHT.issue([op.tensor for op in p2p_op_list], lambda: dist.batch_isend_irecv(ops))


def all_gather_coalesced(
    output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], group: Any = None, async_op: bool = False
) -> Any:
    """Each input gathered into its output (`all_gather_into_tensor` pair by pair, as DeepSpeed's gloo path has no
    coalescing); with `async_op` one handle whose `wait()` waits for every pair."""
    if len(output_tensors) != len(input_tensors):
        raise ValueError(f"all_gather_coalesced: {len(output_tensors)} outputs for {len(input_tensors)} inputs")
    works = [
        all_gather_into_tensor(output, tensor, group=group, async_op=async_op)
        for output, tensor in zip(output_tensors, input_tensors, strict=True)
    ]
    return _AllWorks(works) if async_op else None


class _AllWorks:
    """Works issued together, waited on together."""

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def get_all_ranks_from_group(group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of `group` (the world when None), in group-rank order."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def has_all_gather_into_tensor() -> bool:
    return True  # torch >= 2.6 has it on every backend this library runs on


def has_reduce_scatter_tensor() -> bool:
    return True


def get_local_rank_from_launcher() -> int:
    """LOCAL_RANK (or Open MPI's), 0 without a launcher: DeepSpeed's reading of the launcher's environment."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_world_rank_from_launcher() -> int:
    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0)))


def get_world_size_from_launcher() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", 1)))


def inference_all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, **_: Any) -> Any:
    """DeepSpeed's all-reduce for inference (its shared-memory kernel where built): torch's all-reduce, in place and
    synchronous; the tensor itself on a group of one rank, as DeepSpeed returns it."""
    if dist.get_world_size(group=group) <= 1:
        return tensor
    return all_reduce(tensor, op=op, group=group)


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in `group` (the default group when None); torch.distributed must be initialised."""
    return dist.get_rank(group)


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """The number of processes in `group` (the default group when None)."""
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """The rank on this node, from the launcher's LOCAL_RANK (0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: dist.ProcessGroup | None = None, group_rank: int = 0) -> int:
    """The global rank of `group_rank` in `group` (itself for the default group)."""
    if group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_world_group() -> dist.ProcessGroup:
    """The default (world) process group."""
    return dist.group.WORLD  # type: ignore[return-value]


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict[str, Any] | None:
    """DeepSpeed's `deepspeed.comm.log_summary()`: a barrier, then rank 0 logs the `comms_logger` table of the
    engine's collectives (each live engine with `comms_logger.enabled`); every rank must call it.
    `return_dict` returns the table as DeepSpeed's dict (of the latest engine; {} when none logs).

    Example:
        >>> zeroshard.comm.log_summary()  # doctest: +SKIP
    """
    loggers = LIVE.alive()
    if dist.is_initialized():
        dist.barrier()
    result: dict[str, Any] | None = None
    for comms in loggers:
        print_log = comms.rank == 0
        result = comms.log_all(print_log=print_log, show_straggler=show_straggler, return_dict=return_dict)
    if not return_dict:
        return None
    return result if result is not None else {}


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's `init_distributed` over `comm.topology.init_distributed`.

    As in DeepSpeed, nothing happens when torch.distributed is already initialised (`dist_init_required=True`
    included); `dist_init_required=False` where it is not is refused. An explicit `init_method`, `rank` or
    `world_size` is passed to `torch.distributed.init_process_group`; otherwise the launcher's environment is read, or
    under `mpirun -np N python train.py` the MPI variables with `distributed_port` as the default MASTER_PORT
    (`auto_mpi_discovery`, [Note: MPI discovery] in comm/topology.py), or a one-process group is made. Without `timeout`
    the group's deadline is `zeroshard.collective_timeout_s` of `config` (a ds_config mapping or file), else DeepSpeed's
    DEEPSPEED_TIMEOUT (minutes), else that key's default, as `initialize` starts it (torch's own default, 30 minutes,
    was taken here).

    Example:
        >>> import zeroshard
        >>> zeroshard.init_distributed(dist_backend="gloo")  # doctest: +SKIP
    """
    if dist_init_required is False:  # the script started the group (refused where it did not, as DeepSpeed)
        topology.require_started(False)
        return
    if dist.is_initialized():  # (dist_init_required=True too: DeepSpeed starts no second group)
        return
    from zeroshard.config.features import collective_timeout  # (the config package imports comm)

    timeout_s = timeout.total_seconds() if timeout is not None else collective_timeout(_raw_config(config))
    if init_method is not None or rank >= 0 or world_size >= 0:
        kwargs: dict[str, Any] = {"init_method": init_method, "rank": rank, "world_size": world_size}
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(dist_backend, **kwargs)
    topo = topology.init_distributed(dist_backend, timeout_s, auto_mpi_discovery, distributed_port)
    if verbose:
        logger.info("initialised torch.distributed: rank %d of %d, %s", topo.rank, topo.world_size, topo.backend)


def _raw_config(config: Any) -> Any:
    """`init_distributed(config=...)` as a ds_config mapping: a mapping, or a file or preset name; DeepSpeed's
    config object (`_param_dict`) too."""
    if isinstance(config, str | os.PathLike):
        from zeroshard.presets import load_ds_config

        return load_ds_config(os.fspath(config))
    return getattr(config, "_param_dict", config)


__all__ = [
    "ReduceOp",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "inference_all_reduce",
    "all_to_all",
    "all_to_all_single",
    "batch_isend_irecv",
    "P2POp",
    "get_all_ranks_from_group",
    "get_local_rank_from_launcher",
    "get_world_rank_from_launcher",
    "get_world_size_from_launcher",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]
