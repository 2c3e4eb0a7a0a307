"""`zeroshard accelerate-launch ARGS...`: an `accelerate launch` command line with DeepSpeed selected, on zeroshard.

    zeroshard accelerate-launch --config_file deepspeed_zero3.yaml train.py --bf16
    zeroshard accelerate-launch --use_deepspeed --zero_stage 2 --num_processes 8 train.py
    zeroshard accelerate-launch --dry-run --config_file deepspeed_zero3.yaml train.py

[Note: accelerate launch without DeepSpeed]
`accelerate launch` with DeepSpeed selected (a config file's `distributed_type: DEEPSPEED`, or `--use_deepspeed`)
hands the job to its DeepSpeed launcher, which stops when DeepSpeed is not installed. This command reads the same
arguments and config file by accelerate's own code (`launch_command_parser`, `_validate_launch_command`,
`prepare_deepspeed_cmd_env`), so the processes get the environment `accelerate launch` would give them
(`ACCELERATE_USE_DEEPSPEED`, the ZeRO stage, offload devices, `ACCELERATE_DEEPSPEED_CONFIG_FILE`,
`ACCELERATE_MIXED_PRECISION`, ...), and starts them with `zeroshard launch`: on this node (`num_machines` 1), one
launcher per node (`deepspeed_multinode_launcher` standard or nossh, each node with its `machine_rank`), or every host
of `deepspeed_hostfile` over ssh (pdsh). The MPI and Slurm launchers of DeepSpeed's runner are refused in one line.
In the script, `zeroshard.hf.Accelerator` (a custom loop) and `zeroshard.hf.TrainingArguments` (the Trainer, TRL's
configs through `TrainingArgumentsMixin`) read that environment as accelerate and transformers do under DeepSpeed.
`--dry-run` prints the environment and the `zeroshard launch` command instead of running them.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Sequence
from typing import Any

from zeroshard.cli.common import EXIT_CONFIG, CLIError, add_subcommand, out
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

COMMAND = "accelerate-launch"
OWN_FLAGS = ("--dry-run", "--dry_run", "--debug", "-h", "--help")  # ours, right after the command; then accelerate's
PER_NODE = ("standard", "nossh")  # one launcher per node, as torchrun; pdsh: the hostfile over ssh
# accelerate's torchrun options that zeroshard launch sets its own way: their default, and what is done instead
TORCHRUN_OPTIONS = {
    "rdzv_backend": ("static", "zeroshard launch picks the rendezvous (c10d with --max_restarts or several nodes)"),
    "rdzv_conf": ("", "zeroshard launch picks the rendezvous"),
    "monitor_interval": (0.1, "torchrun's default interval is used"),
    "tee": ("0", "each process's output goes to this console"),
    "log_dir": (None, "each process's output goes to this console"),
    "role": ("default", "torchrun's default role is used"),
}


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = add_subcommand(
        sub, COMMAND, parents, "an `accelerate launch` command line with DeepSpeed selected, run on zeroshard", __doc__
    )
    p.add_argument("--dry-run", "--dry_run", action="store_true", help="print the environment and command; run nothing")
    p.add_argument("accelerate_args", nargs=argparse.REMAINDER, help="accelerate launch's arguments and the script")
    p.set_defaults(run=run)


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """`zeroshard [--debug] accelerate-launch [OWN_FLAGS] REST`: (what zeroshard parses, REST for accelerate's
    parser); REST is None for other commands. argparse cannot hand options it does not know to a positional."""
    argv = list(argv)
    command = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if command is None or argv[command] != COMMAND:
        return argv, None
    end = command + 1
    while end < len(argv) and argv[end] in OWN_FLAGS:
        end += 1
    return argv[:end], argv[end:]


def run(args: argparse.Namespace) -> int:
    from zeroshard.cli.main import build_parser

    launch_argv, env = launch_command(args.accelerate_args)
    if args.dry_run:
        out(shlex.join([*(f"{k}={v}" for k, v in sorted(env.items())), "zeroshard", "launch", *launch_argv]))
        return 0
    os.environ.update(env)
    launch = build_parser().parse_args(["launch", *launch_argv])
    launch.export_env = env  # to every node, over .deepspeed_env's lines (accelerate appends them to that file)
    return int(launch.run(launch))


def launch_command(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """accelerate launch's `argv` -> (`zeroshard launch`'s arguments, the variables accelerate would set that differ
    from this environment)."""
    try:
        from accelerate.commands.launch import _validate_launch_command, launch_command_parser
        from accelerate.utils.launch import prepare_deepspeed_cmd_env
    except ImportError as e:
        raise CLIError(f"{COMMAND} reads accelerate's arguments with accelerate: pip install accelerate ({e})") from e
    if not argv:
        raise CLIError(f"{COMMAND}: no training script; e.g. {COMMAND} --config_file ds.yaml train.py", EXIT_CONFIG)
    a = launch_command_parser().parse_args(list(argv))
    try:
        a, defaults, mixed_precision_from_config = _validate_launch_command(a)
    except ValueError as e:
        raise CLIError(f"{COMMAND}: {e}", EXIT_CONFIG) from e
    if not a.use_deepspeed or a.cpu:
        chosen = "--cpu" if a.cpu else "no DeepSpeed (distributed_type DEEPSPEED or --use_deepspeed)"
        raise CLIError(
            f"{COMMAND}: the arguments select {chosen}, so accelerate would not use DeepSpeed; zeroshard takes "
            "DeepSpeed's place only: run `accelerate launch` itself",
            EXIT_CONFIG,
        )
    if not a.num_processes:
        raise CLIError(
            f"{COMMAND}: no process count (accelerate counts {a.num_processes} GPUs here): pass --num_processes N "
            "or set num_processes in the config file",
            EXIT_CONFIG,
        )
    fields = list(defaults.deepspeed_config) if defaults is not None else []  # as `accelerate launch` does
    a.deepspeed_fields_from_accelerate_config = ",".join(fields + ["mixed_precision"] * mixed_precision_from_config)
    machines = int(a.num_machines or 1)
    launcher = a.deepspeed_multinode_launcher or "pdsh"
    if machines > 1 and launcher not in (*PER_NODE, "pdsh"):
        raise CLIError(
            f"{COMMAND}: deepspeed_multinode_launcher {launcher!r} starts DeepSpeed's runner; with zeroshard use "
            "'standard' (run this command on every node with its --machine_rank) or 'pdsh' with a "
            "deepspeed_hostfile (ssh); under Slurm or mpirun, `zeroshard launch` itself reads the node rank",
            EXIT_CONFIG,
        )
    if machines > 1 and launcher in PER_NODE and (a.machine_rank is None or not a.main_process_ip):
        raise CLIError(f"{COMMAND}: {machines} machines: set machine_rank and main_process_ip", EXIT_CONFIG)
    a.deepspeed_multinode_launcher = "standard" if launcher == "nossh" else launcher  # nossh asks DeepSpeed's version
    try:
        _, env = prepare_deepspeed_cmd_env(a)
    except (ValueError, RuntimeError, ConnectionError) as e:
        raise CLIError(f"{COMMAND}: {e}", EXIT_CONFIG) from e
    _warn_unused(a)
    _without_p2p(env)
    return _launch_argv(a, machines, launcher), {k: v for k, v in env.items() if os.environ.get(k) != v}


def _without_p2p(env: dict[str, str]) -> None:
    """accelerate's DeepSpeed launcher turns NCCL's P2P and InfiniBand off on GPUs without them (RTX 4000)."""
    from accelerate.utils import check_cuda_p2p_ib_support

    if not check_cuda_p2p_ib_support():
        for key in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"):
            env.setdefault(key, "1")


def _launch_argv(a: argparse.Namespace, machines: int, launcher: str) -> list[str]:
    """`zeroshard launch`'s arguments for what accelerate's DeepSpeed launcher would start."""
    filtered = machines > 1 and launcher == "pdsh" and (a.deepspeed_exclusion_filter or a.deepspeed_inclusion_filter)
    argv = [] if filtered else ["--nproc_per_node", str(int(a.num_processes) // machines)]  # a filter: its slots
    argv += ["--cluster", "none"]
    if not getattr(a, "standalone", False):  # accelerate found its port taken: torchrun --standalone picks one
        argv += ["--master_port", str(a.main_process_port)]
    if machines > 1 and launcher in PER_NODE:
        argv += ["--nnodes", str(machines), "--node_rank", str(a.machine_rank), "--master_addr", a.main_process_ip]
    elif machines > 1:  # pdsh: DeepSpeed's runner on every host of the hostfile (here over ssh)
        if not a.deepspeed_hostfile:
            raise CLIError(f"{COMMAND}: the pdsh launcher needs deepspeed_hostfile (lines 'HOST slots=N')", EXIT_CONFIG)
        argv += ["--hostfile", str(a.deepspeed_hostfile)]
        if a.deepspeed_exclusion_filter:
            argv += ["--exclude", str(a.deepspeed_exclusion_filter)]
        elif a.deepspeed_inclusion_filter:
            argv += ["--include", str(a.deepspeed_inclusion_filter)]
        if a.main_process_ip:
            argv += ["--master_addr", a.main_process_ip]
    if int(a.max_restarts or 0):
        argv += ["--max_restarts", str(a.max_restarts)]
    argv += ["--no_local_rank"]  # accelerate starts its scripts without it (torchrun; DeepSpeed's with --no_local_rank)
    argv += ["-m"] if a.module else ["--no_python"] if a.no_python else []
    return [*argv, a.training_script, *a.training_script_args]


def _warn_unused(a: argparse.Namespace) -> None:
    for name, (default, instead) in TORCHRUN_OPTIONS.items():
        value = getattr(a, name, default)
        if value is not None and value != default and str(value) != str(default):
            logger.warning(f"{COMMAND}: --{name} {value} is not used: {instead}")
