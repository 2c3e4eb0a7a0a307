"""`zeroshard launch --print-sbatch`: the Slurm batch script that runs this launch on N nodes. Pure.

The script starts one `zeroshard launch` per node with srun ([Note: one launcher per node under a
scheduler]); each reads SLURM_NODEID, SLURM_JOB_NUM_NODES and SLURM_JOB_NODELIST and joins the c10d
rendezvous on the first host of the allocation.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence


def sbatch_script(
    launch_args: Sequence[str], nnodes: int, nproc_per_node: int, job_name: str = "zeroshard", gpus: bool = True
) -> str:
    """The batch script; `launch_args` are the `zeroshard launch` arguments after the per-node ones."""
    gpu_line = f"#SBATCH --gpus-per-node={nproc_per_node}\n" if gpus else ""
    command = shlex.join(["zeroshard", "launch", "--nproc_per_node", str(nproc_per_node), *launch_args])
    return (
        "#!/bin/bash\n"
        f"#SBATCH --job-name={job_name}\n"
        f"#SBATCH --nodes={nnodes}\n"
        "#SBATCH --ntasks-per-node=1          # one zeroshard launch per node; it starts the node's workers\n"
        "#SBATCH --exclusive                  # and their cores: one task alone gets one core by default\n"
        f"{gpu_line}"
        "#SBATCH --output=%x-%j.out\n"
        "set -euo pipefail\n"
        "# zeroshard launch reads SLURM_NODEID, SLURM_JOB_NUM_NODES and SLURM_JOB_NODELIST (its first host is the\n"
        "# c10d rendezvous host); the port is MASTER_PORT if exported, else 20000 + SLURM_JOB_ID % 20000. The task\n"
        "# gets the node's cores, which the launcher divides between its workers (OMP_NUM_THREADS).\n"
        'srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=1 '
        f"{command}\n"
    )
