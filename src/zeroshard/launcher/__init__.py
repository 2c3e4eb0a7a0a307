"""Launching on torchrun (torch.distributed.run): hostfiles, per-node commands, elastic-safe init.

    >>> from zeroshard.launcher import LaunchOptions, single_node
    >>> argv = single_node(LaunchOptions("train.py", ["--lr", "1e-4"]), nproc=2)
    >>> argv[3:7]
    ['--nproc_per_node', '2', '--standalone', '--max_restarts']

Modules: hostfile (DeepSpeed's hostfile and --include/--exclude, pure), plan (torchrun argv per
node, pure), runner (starts them), rendezvous (per-attempt store for elastic restarts).
"""

from zeroshard.launcher.hostfile import LaunchError, read_hostfile, select_resources
from zeroshard.launcher.plan import LaunchOptions, NodeCommand, multi_node, single_node
from zeroshard.launcher.rendezvous import attempt_store, init_process_group_from_env

__all__ = [
    "LaunchError",
    "LaunchOptions",
    "NodeCommand",
    "attempt_store",
    "init_process_group_from_env",
    "multi_node",
    "read_hostfile",
    "select_resources",
    "single_node",
]
