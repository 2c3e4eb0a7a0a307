"""[Note: MPI discovery]: `mpirun -np N python train.py` without a launcher, as DeepSpeed's init_distributed allows."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.comm.topology import mpi_rank_env

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_openmpi_and_mpich_variables_become_torchrun_variables() -> None:
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node0"}  # fmt: skip
    assert mpi_rank_env(ompi) == {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                  "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}  # fmt: skip
    mpich = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h",
             "MASTER_PORT": "1234"}  # fmt: skip
    assert mpi_rank_env(mpich)["MASTER_PORT"] == "1234" and mpi_rank_env(mpich)["LOCAL_WORLD_SIZE"] == "2"
    assert mpi_rank_env({**ompi, "RANK": "3"}) == {}  # torchrun (or a launcher) already set it
    assert mpi_rank_env({}) == {}


def test_missing_master_addr_is_one_clear_error() -> None:
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set: export rank 0's host"):
        mpi_rank_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by MPI discovery: its unit checks
@pytest.mark.slow
def test_two_processes_started_as_mpirun_would_form_one_group() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = (
        "import torch, torch.distributed as dist\n"
        "from zeroshard.comm.topology import init_distributed\n"
        "topo = init_distributed()\n"
        "t = torch.tensor([topo.rank + 1.0]); dist.all_reduce(t)\n"
        "print(topo.rank, topo.world_size, topo.local_rank, int(t.item()))\n"
        "dist.destroy_process_group()\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env={
                **base,
                "PYTHONPATH": SRC,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMPI_COMM_WORLD_RANK": str(r),
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert sorted(out.split()[:4] for out, _ in outs) == [["0", "2", "0", "3"], ["1", "2", "1", "3"]]
