"""`zeroshard launch [options] script.py args...`: torchrun on this node, or on every host of a hostfile.

    zeroshard launch --nproc_per_node 2 train.py --deepspeed ds_config.json
    zeroshard launch --nproc_per_node 2 -m zeroshard.cli.train --model tiny-llama --zero-stage 2
    zeroshard launch --hostfile hosts --include "worker-0@worker-1:0,1" --dry-run train.py

Every worker runs `python -u script --local_rank=N args` as under DeepSpeed's launcher (`--no_local_rank` leaves the
argument out; the LOCAL_RANK variable is set either way). Multi-node starts one torchrun per host over ssh
(`--dry-run` prints the per-node commands instead).
`--max_restarts R` restarts the whole group after a failure (torchrun's elastic agent); `zeroshard
train` then resumes from the latest checkpoint.

Under Slurm (srun), mpirun or Kubernetes (PyTorchJob, Indexed Job/JobSet) one launcher runs per node
and reads its node rank, the node count and the rendezvous host from the scheduler's variables
(launcher/cluster.py; `--cluster none` ignores them). `--print-sbatch` prints a batch script for
`--nnodes` nodes. A node lost mid-run is named by the others, which stop within the heartbeat timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from zeroshard.cli.common import EXIT_CONFIG, CLIError, add_subcommand, out
from zeroshard.launcher.plan import DEFAULT_MASTER_PORT
from zeroshard.utils.logging import get_logger

if TYPE_CHECKING:
    from zeroshard.launcher.plan import LaunchOptions

logger = get_logger(__name__)
PID_FILE = "/tmp/<pid>.deepspeed"  # DeepSpeed's --save_pid file (its PID_FILE_BASEPATH), removed at exit


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = add_subcommand(
        sub,
        "launch",
        parents,
        "start a training script on torchrun (one node, or every host of a hostfile over ssh)",
        __doc__,
    )
    p.add_argument("--nproc_per_node", "--nproc-per-node", "--num_gpus", type=int, help="processes per node")
    p.add_argument("--nnodes", "--num_nodes", type=int, help="number of nodes (the first K hosts of the hostfile)")
    p.add_argument("--node_rank", "--node-rank", type=int, help="this node's rank (multi-node without a hostfile)")
    p.add_argument("-H", "--hostfile", help="DeepSpeed-style hostfile: lines 'HOST slots=N'")
    p.add_argument("-i", "--include", help='hosts/slots to use, e.g. "worker-0@worker-1:0,2"')
    p.add_argument("-e", "--exclude", help='hosts/slots to skip, e.g. "worker-1:0"')
    p.add_argument("--master_addr", "--master-addr", help="rendezvous host (default: the first host)")
    p.add_argument("--master_port", "--master-port", type=int, help="rendezvous port (default 29500)")
    p.add_argument("--max_restarts", "--max-restarts", type=int, default=0, help="elastic restarts of the group")
    p.add_argument("--rdzv_id", "--rdzv-id", default="zeroshard", help="job id for the c10d rendezvous")
    p.add_argument("--ssh_port", "--ssh-port", type=int, help="ssh port of the remote hosts")
    p.add_argument("-m", "--module", action="store_true", help="the script is a Python module name (python -m)")
    p.add_argument("--no_python", "--no-python", action="store_true", help="run the script as an executable")
    p.add_argument(
        "--no_local_rank",
        "--no-local-rank",
        action="store_true",
        help="do not pass --local_rank=N to the script (passed by default, as DeepSpeed's launcher does)",
    )
    p.add_argument(
        "--enable_each_rank_log",
        "--enable-each-rank-log",
        metavar="DIR",
        help="each rank's stdout and stderr to DIR/<launch time>_rank<RANK>.log (DeepSpeed's option)",
    )
    p.add_argument(
        "--bind_cores_to_rank",
        "--bind-cores-to-rank",
        action="store_true",
        help="each worker on its own share of the node's cores, OMP_NUM_THREADS set to it (DeepSpeed's option)",
    )
    p.add_argument(
        "--bind_core_list",
        "--bind-core-list",
        metavar="CORES",
        help='the cores to share out, e.g. "0-7,16-23" (implies --bind_cores_to_rank; default: every core)',
    )
    p.add_argument(
        "--no_ssh",
        "--no-ssh",
        action="store_true",
        help="with --hostfile and --node_rank: start only this node (run the same command on every node)",
    )
    p.add_argument(
        "--force_multi",
        "--force-multi",
        action="store_true",
        help="start even a single host as a node of a multi-node job (its command watched as a remote one's)",
    )
    p.add_argument("--save_pid", "--save-pid", action="store_true", help=f"write this launcher's pid to {PID_FILE}")
    p.add_argument("--launcher", help='DeepSpeed\'s multi-node backend: only "pdsh" (nodes start over ssh)')
    p.add_argument("--launcher_args", help=argparse.SUPPRESS)
    p.add_argument("--autotuning", help=argparse.SUPPRESS)
    p.add_argument("--dry-run", "--dry_run", action="store_true", help="print the commands instead of running them")
    p.add_argument(
        "--cluster",
        choices=("auto", "none", "slurm", "mpi", "kubernetes"),
        default="auto",
        help="read node rank/count/master from this scheduler's environment (default: detect it)",
    )
    p.add_argument("--print-sbatch", "--print_sbatch", action="store_true", help="print a Slurm batch script")
    p.add_argument(
        "--heartbeat-timeout",
        "--heartbeat_timeout",
        type=float,
        default=15.0,
        help="seconds without a heartbeat after which another node counts as lost (multi-node)",
    )
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    p.set_defaults(run=run)


DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's (DLTS_HOSTFILE)


def run(args: argparse.Namespace) -> int:
    from zeroshard.launcher import LaunchOptions

    for name in ("nproc_per_node", "nnodes", "master_port"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CLIError(f"--{name} {value} must be >= 1", EXIT_CONFIG)
    if args.max_restarts < 0:
        raise CLIError(f"--max_restarts {args.max_restarts} must be >= 0", EXIT_CONFIG)
    if _default_hostfile_applies(args):  # DeepSpeed's default, used where it exists
        logger.info(f"zeroshard launch: using the hostfile {DEFAULT_HOSTFILE} (DeepSpeed's default; -H names another)")
        args.hostfile = DEFAULT_HOSTFILE
    _check_before_starting(args)
    bind = args.bind_core_list if args.bind_core_list is not None else "all" if args.bind_cores_to_rank else None
    opts = LaunchOptions(
        script=args.script,
        script_args=list(args.script_args),
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        module=args.module,
        no_python=args.no_python,
        local_rank_arg=not args.no_local_rank,
        each_rank_log=args.enable_each_rank_log,
        log_prefix=time.strftime("%Y%m%d%H%M%S"),
        rdzv_id=args.rdzv_id,
        ssh_port=args.ssh_port,
        bind_cores=bind,
    )
    if args.print_sbatch:
        return _print_sbatch(args)
    if args.dry_run or not args.save_pid:
        return _launch(args, opts)
    with _saved_pid():
        return _launch(args, opts)


def _default_hostfile_applies(args: argparse.Namespace) -> bool:
    """`/job/hostfile` where it exists and nothing else chose the nodes: not with `--nnodes/--node_rank/--master_addr`
    (each node started on its own), a scheduler's job (each node's launcher starts its own node) or `--cluster none`
    (accelerate-launch's one machine)."""
    if args.hostfile is not None or not os.path.isfile(DEFAULT_HOSTFILE) or args.cluster != "auto":
        return False
    if args.nnodes is not None or args.node_rank is not None or args.master_addr is not None:
        return False
    from zeroshard.launcher.cluster import detect

    return detect(os.environ, args.cluster) is None


def _launch(args: argparse.Namespace, opts: LaunchOptions) -> int:
    from zeroshard.launcher import multi_node, read_hostfile, select_resources, single_node
    from zeroshard.launcher.hostfile import limit_resources
    from zeroshard.launcher.plan import exported_environment
    from zeroshard.launcher.runner import run_local, run_nodes

    if args.hostfile is None:
        opts = _with_cluster(opts, args.cluster)
    if args.hostfile is not None and args.node_rank is not None and not args.no_ssh:
        raise CLIError(
            "--node_rank is for multi-node runs without a hostfile; with --hostfile, ranks follow its order "
            "(--no_ssh --node_rank I starts only node I)"
        )
    if args.hostfile is None and (args.include or args.exclude or args.force_multi):
        hosts: dict[str, int] | None = {"localhost": args.nproc_per_node or _local_slots()}
    else:
        hosts = read_hostfile(args.hostfile) if args.hostfile else None
    if hosts is None:
        nproc = opts.nproc_per_node or _local_slots()
        _check_binding(opts, nproc)
        argv = single_node(opts, nproc)
        if args.dry_run:
            out(shlex.join(argv))
            return 0
        if (opts.nnodes or 1) > 1 and opts.master_addr:
            return _run_node(opts, argv, nproc, args.heartbeat_timeout)
        if opts.master_addr or opts.master_port:  # (--standalone picks a free port itself)
            _refuse_busy_port(opts.master_port or DEFAULT_MASTER_PORT)
        return run_local(argv, nproc)
    resources = limit_resources(select_resources(hosts, args.include, args.exclude), args.nnodes, args.nproc_per_node)
    cwd = os.getcwd()
    exported = exported_environment(os.environ, cwd, os.path.expanduser("~"))
    nodes = multi_node(opts, resources, {**exported, **getattr(args, "export_env", {})})  # accelerate-launch's win
    if args.no_ssh:
        return _run_this_node(args, opts, nodes, cwd)
    for node in nodes:  # this machine's node (a remote one checks its own in each worker: launcher/bind.py)
        if not node.remote and not args.dry_run:
            _check_binding(opts, node.nproc)
    if len(nodes) == 1 and not nodes[0].remote and not args.force_multi:
        local = single_node(opts, nodes[0].nproc)
        env = {k: v for k, v in nodes[0].env.items() if k == "CUDA_VISIBLE_DEVICES"}
        if args.dry_run:
            out(
                shlex.join(local)
                if not env
                else f"env {shlex.join(f'{k}={v}' for k, v in env.items())} {shlex.join(local)}"
            )
            return 0
        os.environ.update(env)
        return run_local(local, nodes[0].nproc)
    if args.dry_run:
        for node in nodes:
            out(f"# node {node.node_rank}: {node.host}, {node.nproc} process(es)")
            out(shlex.join(node.full_argv(cwd)))
        return 0
    return run_nodes(nodes, cwd)


def _run_this_node(args: argparse.Namespace, opts: LaunchOptions, nodes: list[Any], cwd: str) -> int:
    """DeepSpeed's --no_ssh: the same command runs on every node, each starting only its own (--node_rank)."""
    if args.node_rank is None or not 0 <= args.node_rank < len(nodes):
        raise CLIError(
            f"--no_ssh starts only this node: pass --node_rank in 0..{len(nodes) - 1} (its host's place among the "
            "hostfile's hosts)",
            EXIT_CONFIG,
        )
    node = nodes[args.node_rank]
    if args.dry_run:
        out(node.shell_command(cwd))
        return 0
    _check_binding(opts, node.nproc)
    os.environ.update(node.env)
    master = opts.master_addr or nodes[0].host
    placed = dataclasses.replace(opts, nnodes=len(nodes), node_rank=node.node_rank, master_addr=master)
    return _run_node(placed, node.argv, node.nproc, args.heartbeat_timeout)


@contextlib.contextmanager
def _saved_pid() -> Iterator[None]:
    """DeepSpeed's --save_pid: this launcher's pid in /tmp/<pid>.deepspeed while it runs, for a program that started
    it to find what to signal (here the launcher itself: SIGTERM stops every worker)."""
    path = PID_FILE.replace("<pid>", str(os.getpid()))
    out(f"launcher pid: {os.getpid()}")
    with open(path, "w") as handle:
        handle.write(str(os.getpid()))
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _check_binding(opts: LaunchOptions, nproc: int) -> None:
    """--bind_core_list on this machine: cores it may run on, at least one per process ([Note: binding cores to
    ranks]; a remote node checks its own in each worker)."""
    from zeroshard.launcher.bind import ALL, CoreListError, available_cores, parse_core_list, share

    if opts.bind_cores is None:
        return
    try:
        cores = available_cores() if opts.bind_cores == ALL else parse_core_list(opts.bind_cores)
        share(cores, 0, nproc)
    except CoreListError as error:
        raise CLIError(str(error), EXIT_CONFIG) from None
    outside = sorted(set(cores) - os.sched_getaffinity(0))
    if outside:
        raise CLIError(
            f"--bind_core_list {opts.bind_cores}: core(s) {outside} are not this machine's to run on (it may use "
            f"{sorted(os.sched_getaffinity(0))})",
            EXIT_CONFIG,
        )


def _local_slots() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _with_cluster(opts: LaunchOptions, wanted: str) -> LaunchOptions:
    """Fill what the options leave open from the scheduler's environment.

    See [Note: one launcher per node under a scheduler].
    """
    from zeroshard.launcher.cluster import detect

    found = detect(os.environ, wanted)
    if found is None:
        return opts
    nnodes = opts.nnodes or found.nnodes
    master = opts.master_addr or found.master_addr
    if nnodes > 1 and not master:
        raise CLIError(
            f"{found.scheduler}: {nnodes} nodes but no rendezvous host; export MASTER_ADDR (the first node's "
            "address) or pass --master_addr",
            EXIT_CONFIG,
        )
    node_rank = opts.node_rank if opts.node_rank is not None else found.node_rank
    logger.info(
        f"zeroshard launch: {found.scheduler} job {found.job_id or '-'}: node {node_rank} of {nnodes}, "
        f"rendezvous at {master}:{opts.master_port or found.master_port or DEFAULT_MASTER_PORT}"
    )
    return dataclasses.replace(
        opts,
        nnodes=nnodes,
        node_rank=node_rank if nnodes > 1 else None,
        master_addr=master,
        master_port=opts.master_port or found.master_port,
        nproc_per_node=opts.nproc_per_node or found.nproc_per_node,
        rdzv_id=opts.rdzv_id if opts.rdzv_id != "zeroshard" or not found.job_id else f"zeroshard-{found.job_id}",
        c10d=True,
    )


def _run_node(opts: LaunchOptions, argv: list[str], nproc: int, heartbeat_timeout: float) -> int:
    """One node of a multi-node job: torchrun here while the launchers watch each other ([Note: naming a lost node])."""
    from zeroshard.launcher.node_watch import NodeWatch
    from zeroshard.launcher.runner import run_watched

    assert opts.master_addr is not None and opts.nnodes is not None and opts.node_rank is not None
    warn_if_unresolvable(opts.master_addr)
    port = (opts.master_port or DEFAULT_MASTER_PORT) + 1
    watch = NodeWatch(opts.master_addr, port, opts.node_rank, opts.nnodes, lost_after_s=heartbeat_timeout)
    return run_watched(argv, nproc, watch.start(), opts.max_restarts)


def _refuse_busy_port(port: int) -> None:
    """The rendezvous port this node's store will listen on, free: a port in use ended in torch's 40-line traceback
    (DistNetworkError, EADDRINUSE) after the workers had been started."""
    import errno
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds: TIME_WAIT is no conflict
        try:
            probe.bind(("", port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                return  # (another failure is the store's to report)
            raise CLIError(
                f"--master_port {port}: another process listens on it on this host (an earlier run still going?); "
                "pass a free port, or leave --master_port/--master_addr out and a free one is chosen",
                EXIT_CONFIG,
            ) from None


def warn_if_unresolvable(host: str) -> None:
    """A --master_addr this machine cannot resolve made the node wait silently until torchrun's rendezvous timeout.
    Not refused: a cluster's DNS (Kubernetes' headless services) may publish the name only once that pod starts."""
    import socket

    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as error:  # (a malformed name, "a..b", fails in the idna codec)
        logger.warning(
            f"zeroshard launch: --master_addr {host} does not resolve here ({error}); this node waits for it to "
            "(a cluster's DNS may publish it later) until torchrun's rendezvous times out: check the name if it "
            "should resolve now"
        )


def _print_sbatch(args: argparse.Namespace) -> int:
    from zeroshard.launcher.sbatch import sbatch_script

    nnodes = args.nnodes or 1
    nproc = args.nproc_per_node or _local_slots()
    rest = ["--max_restarts", str(args.max_restarts)] if args.max_restarts else []
    rest += ["-m"] if args.module else ["--no_python"] if args.no_python else []
    rest += ["--no_local_rank"] if args.no_local_rank else []
    rest += ["--enable_each_rank_log", args.enable_each_rank_log] if args.enable_each_rank_log else []
    rest += ["--bind_cores_to_rank"] if args.bind_cores_to_rank else []
    rest += ["--bind_core_list", args.bind_core_list] if args.bind_core_list is not None else []
    out(sbatch_script([*rest, args.script, *args.script_args], nnodes, nproc).rstrip("\n"))
    return 0


def _check_before_starting(args: argparse.Namespace) -> None:
    """What no rank could get past, refused before any process starts: a port outside TCP's range, a node rank outside
    the nodes, a script that is not there (each rank failed on it alone, and the launcher named rank 0 first)."""
    if args.module and args.no_python:
        raise CLIError("-m/--module and --no_python cannot be used together (a module runs with python)", EXIT_CONFIG)
    if args.enable_each_rank_log is not None and os.path.isfile(args.enable_each_rank_log):
        raise CLIError(f"--enable_each_rank_log {args.enable_each_rank_log} is a file; name a folder", EXIT_CONFIG)
    if (args.include or args.exclude) and (args.nnodes is not None or args.nproc_per_node is not None):
        raise CLIError(
            "--num_nodes/--num_gpus with --include/--exclude: the filter already chooses the hosts and slots; pass "
            "one of them (DeepSpeed refuses the pair too)",
            EXIT_CONFIG,
        )
    if args.master_port is not None and args.master_port > 65535:
        raise CLIError(f"--master_port {args.master_port} is not a TCP port (1-65535)", EXIT_CONFIG)
    if args.launcher is not None and args.launcher.lower() != "pdsh":
        raise CLIError(
            f"--launcher {args.launcher}: zeroshard launch starts a hostfile's nodes over ssh itself (DeepSpeed's "
            "pdsh); under Slurm or mpirun run one `zeroshard launch` per node inside the job instead (it reads the "
            "scheduler's variables; --print-sbatch writes a Slurm batch script)",
            EXIT_CONFIG,
        )
    if args.launcher_args is not None:
        raise CLIError(
            "--launcher_args: there is no pdsh or mpirun command line here, nodes start over ssh (ssh options go in "
            "~/.ssh/config; --ssh_port sets the port)",
            EXIT_CONFIG,
        )
    if args.autotuning is not None:
        raise CLIError(
            f"--autotuning {args.autotuning}: DeepSpeed's autotuning through the launcher is `zeroshard autotune "
            "--model DIR --nproc-per-node N --config ds_config.json` here (it runs the trials itself and writes the "
            "best config); launch the script with that config",
            EXIT_CONFIG,
        )
    if args.bind_core_list is not None:
        from zeroshard.launcher.bind import CoreListError, parse_core_list

        try:
            parse_core_list(args.bind_core_list)
        except CoreListError as error:
            raise CLIError(str(error), EXIT_CONFIG) from None
    if args.no_ssh and args.hostfile is None and args.node_rank is None:
        raise CLIError("--no_ssh starts only this node of a hostfile's: pass --hostfile and --node_rank", EXIT_CONFIG)
    if args.hostfile is None and args.node_rank is not None and not 0 <= args.node_rank < (args.nnodes or 1):
        raise CLIError(f"--node_rank {args.node_rank} must be in 0..{(args.nnodes or 1) - 1} (--nnodes)", EXIT_CONFIG)
    starts = not args.dry_run and not args.print_sbatch and args.hostfile is None  # (other hosts: their own files)
    if starts and not args.module and not args.no_python and not os.path.isfile(args.script):
        raise CLIError(f"{args.script}: no such script (the path is relative to {os.getcwd()})", EXIT_CONFIG)
