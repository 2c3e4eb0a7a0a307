"""Launching on torchrun (torch.distributed.run): hostfiles, per-node commands, elastic-safe init.

    >>> from zeroshard.launcher import LaunchOptions, single_node
    >>> argv = single_node(LaunchOptions("train.py", ["--lr", "1e-4"]), nproc=2)
    >>> argv[3:7]
    ['--nproc_per_node', '2', '--standalone', '--max_restarts']

Modules: hostfile (DeepSpeed's hostfile and --include/--exclude, pure), plan (torchrun argv per
node, pure), cluster (Slurm/MPI/Kubernetes variables -> this node's place, pure), sbatch (the
--print-sbatch script, pure), runner (starts them), node_watch (heartbeats naming a lost node),
rendezvous (per-attempt store for elastic restarts).
"""

from zeroshard.launcher.cluster import ClusterEnv, detect, expand_nodelist
from zeroshard.launcher.hostfile import LaunchError, read_hostfile, select_resources
from zeroshard.launcher.plan import LaunchOptions, NodeCommand, multi_node, single_node
from zeroshard.launcher.rendezvous import attempt_store, init_process_group_from_env

__all__ = [
    "ClusterEnv",
    "LaunchError",
    "LaunchOptions",
    "NodeCommand",
    "attempt_store",
    "detect",
    "expand_nodelist",
    "init_process_group_from_env",
    "multi_node",
    "read_hostfile",
    "select_resources",
    "single_node",
]
