"""Where this node sits in a cluster job, read from the scheduler's environment. Pure functions.

[Note: one launcher per node under a scheduler]
Slurm (`srun --ntasks-per-node=1`), MPI (`mpirun` with one process per node) and Kubernetes (one pod per
node) start one `zeroshard launch` per node; each then starts its node's workers with torchrun on the c10d
rendezvous (`--rdzv_backend c10d --rdzv_endpoint MASTER:PORT`), whatever the scheduler. The scheduler
tells each launcher three things: how many nodes, which one it is, and where node 0 is:

- Slurm: nodes SLURM_JOB_NUM_NODES (SLURM_NNODES), this node SLURM_NODEID, node 0 the first host of
  SLURM_JOB_NODELIST (compressed forms such as `node[01-03,07]` are expanded).
- OpenMPI: OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_RANK; MPICH/Hydra: PMI_SIZE and PMI_RANK; node 0 is
  MASTER_ADDR (`mpirun -x MASTER_ADDR`, `mpiexec -genv MASTER_ADDR ...`): MPI does not say it.
- Kubernetes: PET_NNODES (PyTorchJob) or NNODES (Indexed Job / JobSet manifest), else WORLD_SIZE counting
  pods; this node PET_NODE_RANK, JOB_COMPLETION_INDEX or RANK; node 0 PET_MASTER_ADDR or MASTER_ADDR.

The port is MASTER_PORT (PET_MASTER_PORT) when set; under Slurm without one it is derived from the job
id, so two jobs sharing a node do not collide. Explicit launch options override everything read here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from zeroshard.launcher.hostfile import LaunchError

SCHEDULERS = ("slurm", "mpi", "kubernetes")
_GROUP = re.compile(r"\[([^\]]*)\]")


@dataclass(frozen=True)
class ClusterEnv:
    """This node's place in the job, as the scheduler's variables give it."""

    scheduler: str
    nnodes: int
    node_rank: int
    master_addr: str | None
    master_port: int | None = None
    nproc_per_node: int | None = None
    job_id: str | None = None


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list: `node[01-03,07],gpu-a[1-2]b` -> node01 node02 node03 node07 gpu-a1b gpu-a2b."""
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(part))
    if not hosts:
        raise LaunchError(f"Slurm node list {nodelist!r} names no hosts")
    return hosts


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(pattern: str) -> list[str]:
    match = _GROUP.search(pattern)
    if match is None:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    out: list[str] = []
    for item in match.group(1).split(","):
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise LaunchError(f"Slurm node list range {item!r} in {pattern!r} is not N or N-M")
        width = len(low)  # node[01-10]: zero padding is kept
        for number in range(int(low), int(high if dash else low) + 1):
            out.extend(f"{head}{number:0{width}d}{rest}" for rest in _expand_one(tail))
    return out


def detect(environ: Mapping[str, str], wanted: str = "auto") -> ClusterEnv | None:
    """The scheduler's view of this node (MPI first: mpirun inside a Slurm allocation is an MPI job), or None."""
    readers = {"mpi": _mpi, "slurm": _slurm, "kubernetes": _kubernetes}
    if wanted == "none":
        return None
    if wanted != "auto":
        found = readers[wanted](environ)
        if found is None:
            raise LaunchError(f"--cluster {wanted}: none of its variables are set ({_HINTS[wanted]})")
        return found
    for reader in readers.values():
        found = reader(environ)
        if found is not None:
            return found
    return None


_HINTS = {
    "slurm": "SLURM_JOB_ID, SLURM_NODEID, SLURM_JOB_NUM_NODES, SLURM_JOB_NODELIST",
    "mpi": "OMPI_COMM_WORLD_SIZE/RANK or PMI_SIZE/RANK",
    "kubernetes": "PET_NNODES/PET_NODE_RANK, JOB_COMPLETION_INDEX, or WORLD_SIZE/RANK with MASTER_ADDR",
}


def _int(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            digits = value.split("(")[0]  # SLURM_TASKS_PER_NODE-style "2(x3)" keeps its first count
            if not digits.isdigit():
                raise LaunchError(f"{name}={value!r} is not a whole number")
            return int(digits)
    return None


def _port(environ: Mapping[str, str], *names: str) -> int | None:
    return _int(environ, *names)


def _slurm(environ: Mapping[str, str]) -> ClusterEnv | None:
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job:
        return None
    nnodes = _int(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1
    ntasks = _int(environ, "SLURM_NTASKS", "SLURM_NPROCS")
    if nnodes > 1 and "SLURM_STEP_ID" not in environ and "SLURM_STEPID" not in environ:
        raise LaunchError(
            f"Slurm job {job} has {nnodes} nodes but this is the batch script, not a job step: start one "
            "launcher per node with `srun --ntasks-per-node=1 zeroshard launch ...` (see --print-sbatch)"
        )
    if ntasks is not None and nnodes > 1 and ntasks != nnodes:
        raise LaunchError(
            f"Slurm step runs {ntasks} tasks on {nnodes} nodes; zeroshard launch starts a node's workers itself, "
            "so run one task per node: srun --ntasks-per-node=1"
        )
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    master = environ.get("MASTER_ADDR") or (expand_nodelist(nodelist)[0] if nodelist else None)
    port = _port(environ, "MASTER_PORT")
    if port is None and job.isdigit():
        port = 20000 + int(job) % 20000
    return ClusterEnv(
        "slurm",
        nnodes,
        _int(environ, "SLURM_NODEID") or 0,
        master,
        port,
        _int(environ, "SLURM_GPUS_ON_NODE"),
        job,
    )


def _mpi(environ: Mapping[str, str]) -> ClusterEnv | None:
    if "OMPI_COMM_WORLD_SIZE" in environ:
        size, rank = _int(environ, "OMPI_COMM_WORLD_SIZE"), _int(environ, "OMPI_COMM_WORLD_RANK")
        local = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
        job = environ.get("OMPI_MCA_orte_hnp_uri", "").split(".")[0] or None
    elif "PMI_SIZE" in environ:
        size, rank = _int(environ, "PMI_SIZE"), _int(environ, "PMI_RANK")
        local = _int(environ, "MPI_LOCALNRANKS")
        job = None
    else:
        return None
    if local is not None and local > 1:
        raise LaunchError(
            f"mpirun started {local} processes on this node; zeroshard launch starts a node's workers itself, "
            "so start one per node (OpenMPI: --map-by ppr:1:node; MPICH: -ppn 1)"
        )
    return ClusterEnv("mpi", size or 1, rank or 0, environ.get("MASTER_ADDR"), _port(environ, "MASTER_PORT"), None, job)


def _kubernetes(environ: Mapping[str, str]) -> ClusterEnv | None:
    nnodes = _int(environ, "PET_NNODES")
    rank = _int(environ, "PET_NODE_RANK", "JOB_COMPLETION_INDEX")
    master = environ.get("PET_MASTER_ADDR") or environ.get("MASTER_ADDR")
    if nnodes is None and "LOCAL_RANK" not in environ and master and "RANK" in environ:
        nnodes = _int(environ, "WORLD_SIZE")  # PyTorchJob without nprocPerNode: one rank per pod
        rank = _int(environ, "RANK") if rank is None else rank
    if nnodes is None and rank is not None:
        nnodes = _int(environ, "NNODES")  # an Indexed Job / JobSet names it in the manifest
    if nnodes is not None and rank is None and "LOCAL_RANK" not in environ:
        rank = _int(environ, "RANK")  # PyTorchJob sets the pod's index as RANK next to PET_NNODES
    if nnodes is None:
        return None
    if rank is None:
        raise LaunchError(f"{nnodes} Kubernetes nodes but no node rank: set PET_NODE_RANK or JOB_COMPLETION_INDEX")
    return ClusterEnv(
        "kubernetes",
        nnodes,
        rank,
        master,
        _port(environ, "PET_MASTER_PORT", "MASTER_PORT"),
        _count(environ.get("PET_NPROC_PER_NODE") or environ.get("NPROC_PER_NODE")),
        environ.get("PET_RDZV_ID") or environ.get("JOB_NAME") or environ.get("JOBSET_NAME"),
    )


def _count(value: str | None) -> int | None:
    """A process count, or None for torchrun's words ("auto", "gpu") that leave it to the launcher."""
    return int(value) if value and value.strip().isdigit() else None
