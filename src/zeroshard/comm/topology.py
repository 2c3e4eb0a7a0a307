"""Process-group set-up: from torchrun's environment, or a single process with no variables at all."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.errors import ZeroshardError
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its rank in the data-parallel group, its device and backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    group: dist.ProcessGroup | None = None
    # the store keys of checkpoint calls live under this prefix: a pipeline's stages save at once, each with its own
    # ranks 0..dp-1 ([Note: pipeline checkpoints])
    store_prefix: str = ""

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _pick_device(local_rank: int) -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"


def local_device() -> torch.device:
    """This rank's device as `init_distributed` picks it (cuda:LOCAL_RANK modulo the GPUs, made current; the CPU
    without CUDA), for collectives a script's own process group runs before `initialize` (DeepSpeed's zero.Init
    picks and sets it alike). Without LOCAL_RANK (a launcher that does not set it) the current device, as it is."""
    if "LOCAL_RANK" not in os.environ:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return _pick_device(int(os.environ["LOCAL_RANK"]))[0]


def require_started(required: bool | None) -> None:
    """DeepSpeed's `dist_init_required=False` says the script started the process group: refused where it did not."""
    if required is False and not dist.is_initialized():
        raise ZeroshardError(
            "dist_init_required=False, but torch.distributed is not initialized: start the process group first "
            "(torch.distributed.init_process_group, zeroshard.init_distributed) or leave dist_init_required unset"
        )


def init_distributed(
    backend: str | None = None,
    timeout_s: float | None = None,
    mpi_discovery: bool = True,
    mpi_port: int = 29500,
    required: bool | None = None,
) -> Topology:
    """Initialise torch.distributed once and describe the result.

    Under torchrun (RANK/WORLD_SIZE/MASTER_ADDR set) the env:// rendezvous is used; under mpirun without a
    launcher the MPI variables are read first ([Note: MPI discovery]). With no
    variables at all a one-process group is created on an in-memory store, so `python train.py`
    runs the same code path as a multi-process job. NCCL is chosen on CUDA and gloo on CPU. `required=False`
    (DeepSpeed's `dist_init_required=False`: the script started the group) refuses a group not started.
    """
    require_started(required)
    if mpi_discovery:  # `mpirun -np N python train.py`: [Note: MPI discovery]
        os.environ.update(mpi_rank_env(os.environ, mpi_port))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device, default_backend = _pick_device(local_rank)
    chosen = backend or default_backend
    # two local ranks wrapped onto one GPU (NCCL refuses them as duplicates); not where each process is given its
    # own GPU (srun --gpus-per-task, a per-rank CUDA_VISIBLE_DEVICES: one visible), nor a group the script made
    gpus = torch.cuda.device_count()
    if chosen == "nccl" and not dist.is_initialized() and gpus > 1 and local_rank >= gpus:
        raise ZeroshardError(
            f"LOCAL_RANK {local_rank} on a node with {gpus} visible GPUs: start at most that "
            "many processes per node (nproc_per_node), or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    if not dist.is_initialized():
        kwargs = {}
        if timeout_s is not None:
            import datetime

            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ and "MASTER_ADDR" in os.environ:
            # torchrun's agent store outlives restarts: one store namespace per attempt (launcher/rendezvous.py)
            from zeroshard.launcher.rendezvous import init_process_group_from_env

            init_process_group_from_env(chosen, timeout_s or 1800.0)
        elif "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(chosen, init_method="env://", **kwargs)  # type: ignore[arg-type]
        else:
            dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, **kwargs)  # type: ignore[arg-type]
    topo = Topology(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=dist.get_backend(),
        group=None,
    )
    logger.debug("initialised %s", topo)
    return topo


def mpi_rank_env(environ: Mapping[str, str], port: int = 29500) -> dict[str, str]:
    """torchrun's variables for a process that OpenMPI or MPICH started as one rank ({} when RANK is already set or
    no MPI launcher is seen). Pure.

    [Note: MPI discovery]
    DeepSpeed's `init_distributed` (auto_mpi_discovery) lets `mpirun -np 8 python train.py` run without a
    launcher: each MPI process is a rank. Its rank, world size and local rank come from OMPI_COMM_WORLD_* (OpenMPI)
    or PMI_* / MPI_LOCALRANKID (MPICH/Hydra). DeepSpeed asks mpi4py for rank 0's address; zeroshard does not depend
    on mpi4py, so MASTER_ADDR must be exported (`mpirun -x MASTER_ADDR=node0`, `-genv` for MPICH); MASTER_PORT
    defaults to `port` (DeepSpeed's `distributed_port`, 29500). One process per node that runs `zeroshard launch`
    is the other way (docs/cli.md, Clusters)."""
    if "RANK" in environ:
        return {}
    if "OMPI_COMM_WORLD_RANK" in environ:
        rank, size = environ["OMPI_COMM_WORLD_RANK"], environ["OMPI_COMM_WORLD_SIZE"]
        local = environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        local_size = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", size)
    elif "PMI_RANK" in environ and "PMI_SIZE" in environ:
        rank, size = environ["PMI_RANK"], environ["PMI_SIZE"]
        local = environ.get("MPI_LOCALRANKID", environ.get("PMI_LOCAL_RANK", "0"))
        local_size = environ.get("MPI_LOCALNRANKS", environ.get("PMI_LOCAL_SIZE", size))
    else:
        return {}
    if int(size) > 1 and "MASTER_ADDR" not in environ:
        raise RuntimeError(
            f"started by mpirun as rank {rank} of {size}, but MASTER_ADDR is not set: export rank 0's host "
            "(mpirun -x MASTER_ADDR=<host of rank 0> for OpenMPI, -genv MASTER_ADDR <host> for MPICH), or run "
            "`zeroshard launch` once per node (docs/cli.md, Clusters)"
        )
    out = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": local, "LOCAL_WORLD_SIZE": local_size}
    out.setdefault("MASTER_ADDR", environ.get("MASTER_ADDR", "127.0.0.1"))
    out["MASTER_PORT"] = environ.get("MASTER_PORT", str(port))
    return out


RANKS_PER_NODE_ENV = "ZEROSHARD_RANKS_PER_NODE"


@dataclass(frozen=True)
class NodeLayout:
    """Which ranks share a node: consecutive blocks of `ranks_per_node` ranks, as torchrun numbers them. Pure.

    [Note: nodes]
    A node is LOCAL_WORLD_SIZE ranks (torchrun's --nproc-per-node). ZEROSHARD_RANKS_PER_NODE overrides it, so a
    test can run 4 gloo ranks on one machine as 2 nodes x 2 and read intra- and inter-node bytes apart
    ([Note: scopes] in collectives.py). ZeRO++ builds its groups from this layout (zero/zeropp/groups.py).
    """

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"{self.world_size} ranks do not split into nodes of {self.ranks_per_node} "
                f"(LOCAL_WORLD_SIZE or {RANKS_PER_NODE_ENV})"
            )

    @classmethod
    def from_env(cls, world_size: int) -> NodeLayout:
        per_node = os.environ.get(RANKS_PER_NODE_ENV) or os.environ.get("LOCAL_WORLD_SIZE") or str(world_size)
        per_node_int = min(int(per_node), world_size)
        if world_size % per_node_int:  # an odd launch: count the whole job as one node rather than refuse
            logger.warning("%d ranks do not split into nodes of %d: one node assumed", world_size, per_node_int)
            per_node_int = world_size
        return cls(world_size, per_node_int)

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peer_ranks(self, local: int) -> list[int]:
        """The ranks with local index `local` on every node (one per node): qgZ's second hop."""
        return list(range(local, self.world_size, self.ranks_per_node))

    def spans_nodes(self, ranks: list[int]) -> bool:
        return len({self.node_of(r) for r in ranks}) > 1

    def blocks(self, size: int) -> list[list[int]]:
        """Consecutive blocks of `size` ranks (hpZ's partition groups, as DeepSpeed's zero_param_intra groups)."""
        return [list(range(start, start + size)) for start in range(0, self.world_size, size)]


def new_group(ranks: list[int]) -> dist.ProcessGroup | None:
    """A process group over `ranks` (every rank of the world must call this, in the same order; None alone), with
    the world's deadline ([Note: sub-groups keep the world's deadline])."""
    if dist.get_world_size() == 1:
        return None
    return dist.new_group(ranks, timeout=world_timeout())


def world_timeout() -> datetime.timedelta | None:
    """[Note: sub-groups keep the world's deadline]
    torch gives a new process group (`new_group`, a `DeviceMesh`'s dimensions) 30 minutes whatever the world group
    has, so hpZ's, MoE's, a pipeline's, sequence and tensor parallelism's collectives waited 30 minutes where the
    job's deadline (`zeroshard.collective_timeout_s`, 300 s by default) says: every sub-group zeroshard makes takes
    the world's. None where it cannot be read (torch's default then)."""
    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        timeout = group._get_backend(device).options._timeout
        return timeout if isinstance(timeout, datetime.timedelta) else None
    except Exception:  # (another torch's layout, a backend without options)
        return None


def mesh_backend_override(device_type: str, names: tuple[str, ...], sizes: tuple[int, ...]) -> Any:
    """`init_device_mesh(..., backend_override=...)` giving each dimension's new group the world's deadline ([Note:
    sub-groups keep the world's deadline]); a dimension of one rank or of the whole world is left to torch, which
    reuses the world group for the latter (a new world-sized communicator costs NCCL memory). None where the
    backend's options cannot carry a deadline."""
    timeout = world_timeout()
    world = dist.get_world_size()
    wanted = [name for name, size in zip(names, sizes, strict=True) if 1 < size < world]
    if timeout is None or not wanted:
        return None
    backend = _backend_for(dist.get_backend(), device_type)  # ("cpu:gloo,cuda:nccl" when none was named)
    try:
        kind: Any = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
        options = kind.Options() if backend == "nccl" else kind._Options()
        options._timeout = timeout
    except (AttributeError, RuntimeError):  # (a torch without that backend's options)
        return None
    return {name: (backend, options) for name in wanted}


def _backend_for(backend: str, device_type: str) -> str:
    """The backend a group of `backend` uses for `device_type`'s tensors: "gloo", "nccl", or a per-device map."""
    if ":" not in backend:
        return backend
    pairs = dict(item.split(":", 1) for item in backend.split(","))
    return pairs.get(device_type, next(iter(pairs.values())))
