"""From launch options to one torchrun command per node. Pure: nothing is started here.

[Note: rendezvous choice]
Without restarts every node gets a static rendezvous (`--node_rank i --master_addr --master_port`), the
exact shape DeepSpeed's launcher produces. With `--max_restarts > 0` the nodes use torchrun's c10d
rendezvous (`--rdzv_backend c10d --rdzv_endpoint A:P --rdzv_id ID`), which re-forms the group after a
failure; a single node without an address uses `--standalone`. Under a scheduler (cluster.py) every node
uses c10d, restarts or not, and node 0 is told it hosts the store (`--rdzv_conf is_host=1`). Workers of a
restarted group must not read the previous attempt's keys from the shared store: see
`rendezvous.attempt_store`.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from zeroshard.launcher.hostfile import LaunchError, Resources

DEFAULT_MASTER_PORT = 29500
SSH_CONNECT_TIMEOUT_S = 30  # pdsh (DeepSpeed's default multi-node launcher) gives up connecting after 10 s
# what a remote node takes from here (the local node inherits everything): DeepSpeed's prefixes and ours, PYTORCH_
# (the allocator's PYTORCH_CUDA_ALLOC_CONF) and the CUDA runtime's switches, so that every node runs alike; not the
# toolkit's paths (CUDA_HOME), which are each node's own, nor CUDA_VISIBLE_DEVICES, which each node's slots decide
EXPORT_PREFIXES = (
    "NCCL_",
    "PYTHON",
    "MV2_",
    "UCX_",
    "GLOO_",
    "TORCH_",
    "ZEROSHARD_",
    "HF_",
    "OMP_",
    "ACCELERATE_",
    "PYTORCH_",
    "MLFLOW",  # DeepSpeed's runner exports its variables too (MLFLOW_TRACKING_URI, ...)
)
EXPORT_NAMES = frozenset(
    {"CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING", "CUDA_DEVICE_ORDER"}
)
ENV_FILES = (".zeroshard_env", ".deepspeed_env")
# [Note: stopping remote nodes]
# A remote node's torchrun runs under ssh without a terminal, so ending ssh (a Ctrl-C or SIGTERM of the launcher, a
# failed node, the launcher killed) does not end the remote command: its workers trained on, holding their GPUs.
# The launcher gives each node's command (ssh, or bash for a hostfile's own host, in a session of its own) a pipe it
# never writes to (runner.run_nodes), and the node's torchrun wrapper, told by this variable, watches its input:
# when the input closes it sends itself SIGTERM, and torchrun stops its workers. So even a SIGKILL of the launcher
# stops every node. (A single-node launch keeps the terminal's input for its workers: a debugger reads it.)
STOP_WHEN_INPUT_CLOSES = "ZEROSHARD_STOP_WHEN_INPUT_CLOSES"


@dataclass(frozen=True)
class LaunchOptions:
    script: str
    script_args: Sequence[str] = ()
    nproc_per_node: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    module: bool = False
    no_python: bool = False
    # `--local_rank=N` right after the script, as DeepSpeed's launcher passes it: [Note: the --local_rank argument]
    local_rank_arg: bool = False
    # DeepSpeed's --enable_each_rank_log: each worker's stdout and stderr to DIR/<log_prefix>_rank<RANK>.log
    each_rank_log: str | None = None
    log_prefix: str = ""  # the launch's time, as DeepSpeed names those files
    # DeepSpeed's --bind_cores_to_rank (with --bind_core_list): "all" or a core list, each worker on its share
    # ([Note: binding cores to ranks])
    bind_cores: str | None = None
    rdzv_id: str = "zeroshard"
    ssh_port: int | None = None
    # c10d rendezvous even without restarts: [Note: one launcher per node under a scheduler]
    c10d: bool = False


@dataclass(frozen=True)
class NodeCommand:
    """What runs on one node: torchrun's argv, the environment it needs, and how to reach the host."""

    host: str
    node_rank: int
    nproc: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    remote: bool = False
    ssh_port: int | None = None

    def shell_command(self, cwd: str, watch_input: bool = False) -> str:
        """The command line the node runs (cd, environment, torchrun). Without OMP_NUM_THREADS the node divides its
        own cores between its processes, as a local launch does (`runner.thread_env`; torchrun would set 1).
        `watch_input`: torchrun stops when its input closes ([Note: stopping remote nodes]; not in the commands
        --dry-run prints, which a user may run with no input at all)."""
        variables = {**self.env, STOP_WHEN_INPUT_CLOSES: "1"} if watch_input else self.env
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(variables.items()))
        env = f"env {exports} " if exports else ""
        threads = ""
        if "OMP_NUM_THREADS" not in self.env and self.nproc > 1:  # (one set on the node itself wins)
            share = f't=$(( $(nproc) / {self.nproc} )); [ "$t" -ge 1 ] || t=1'
            threads = f'{{ {share}; export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-$t}}"; }} && '
        return f"cd {shlex.quote(cwd)} && {threads}{env}{shlex.join(self.argv)}"

    def full_argv(self, cwd: str, watch_input: bool = False) -> list[str]:
        """The argv to run here: ssh for a remote node, bash for the local one (`watch_input`: `shell_command`'s)."""
        if not self.remote:
            return ["bash", "-c", self.shell_command(cwd, watch_input)]
        port = ["-p", str(self.ssh_port)] if self.ssh_port else []
        # a host that does not answer fails in SSH_CONNECT_TIMEOUT_S (the system's TCP timeout, minutes, otherwise)
        timeout = ["-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}"]
        return ["ssh", "-o", "BatchMode=yes", *timeout, *port, self.host, self.shell_command(cwd, watch_input)]


def torchrun_prefix() -> list[str]:
    """torch.distributed.run through a wrapper that only shortens its failure report (see torchrun.py)."""
    return [sys.executable, "-m", "zeroshard.launcher.torchrun"]


def _program(opts: LaunchOptions) -> list[str]:
    flags = ["-m"] if opts.module else ["--no_python"] if opts.no_python else []
    if not opts.local_rank_arg and opts.each_rank_log is None and opts.bind_cores is None:
        return [*flags, opts.script, *opts.script_args]
    # [Note: the --local_rank argument]
    # DeepSpeed's launcher starts every worker as `python -u script --local_rank=N ARGS` (unless --no_local_rank), and
    # DeepSpeed scripts take their device from it (`torch.cuda.set_device(args.local_rank)`; without it every rank
    # would use GPU 0). torchrun gives all its workers the same arguments and each its LOCAL_RANK variable, so every
    # worker is a shell that puts its own LOCAL_RANK into that command line and execs it: the script runs in the
    # worker's process (torchrun's signals reach it) with DeepSpeed's exact argv; the script's arguments pass as the
    # shell's positional parameters, untouched.
    # The same shell writes the worker's output to its own file under --enable_each_rank_log, as DeepSpeed's does.
    # The same shell starts the worker on its share of the node's cores under --bind_cores_to_rank.
    python = "" if opts.no_python else f"{shlex.quote(sys.executable)} -u {'-m ' if opts.module else ''}"
    if opts.bind_cores is not None:
        script = shlex.quote(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bind.py"))
        bind = f"{shlex.quote(sys.executable)} -S {script} {shlex.quote(opts.bind_cores)} -- "
        python = bind + python
    rank_arg = ' --local_rank="$LOCAL_RANK"' if opts.local_rank_arg else ""
    command = f'exec {python}{shlex.quote(opts.script)}{rank_arg} "$@"'
    if opts.each_rank_log is not None:
        folder = shlex.quote(opts.each_rank_log)
        command = f'mkdir -p {folder} && {command} > {folder}/{opts.log_prefix}_rank"$RANK".log 2>&1'
    return ["--no_python", "/bin/sh", "-c", command, "zeroshard-worker", *opts.script_args]


def single_node(opts: LaunchOptions, nproc: int) -> list[str]:
    """torchrun's argv for one node (this one): standalone, or static/c10d when an address is given."""
    argv = [*torchrun_prefix(), "--nproc_per_node", str(nproc)]
    if opts.nnodes not in (None, 1) or opts.node_rank is not None:
        if opts.nnodes in (None, 1) or opts.node_rank is None or not opts.master_addr:
            raise LaunchError(
                "multi-node without a hostfile needs --nnodes K --node_rank I --master_addr A on every node "
                "(or pass --hostfile to start all nodes from here over ssh)"
            )
        return argv + _rendezvous(opts, opts.nnodes, opts.node_rank, opts.master_addr) + _program(opts)
    if opts.master_addr or opts.master_port:
        return argv + _rendezvous(opts, 1, 0, opts.master_addr or "127.0.0.1") + _program(opts)
    return argv + ["--standalone", "--max_restarts", str(opts.max_restarts)] + _program(opts)


def _rendezvous(opts: LaunchOptions, nnodes: int | None, node_rank: int, master_addr: str) -> list[str]:
    port = opts.master_port or DEFAULT_MASTER_PORT
    if opts.max_restarts > 0 or opts.c10d:
        # node 0 hosts the rendezvous store: on one machine (tests) no other node can take its port first
        host = ["--rdzv_conf", f"is_host={int(node_rank == 0)}"] if opts.c10d else []
        return [
            "--nnodes",
            str(nnodes),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            f"{master_addr}:{port}",
            "--rdzv_id",
            opts.rdzv_id,
            *host,
            "--max_restarts",
            str(opts.max_restarts),
        ]
    return [
        "--nnodes",
        str(nnodes),
        "--node_rank",
        str(node_rank),
        "--master_addr",
        master_addr,
        "--master_port",
        str(port),
    ]


def _through(visible: str, slots: list[int], host: str) -> str:
    """`slots` (indices of the GPUs this process sees) as the device ids of CUDA_VISIBLE_DEVICES=`visible`: with
    4,5,6,7 given, slots 1,2 are GPUs 5 and 6 (written as 1,2 they named GPUs 1 and 2, outside what was given)."""
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    beyond = [s for s in slots if s >= len(ids)]
    if beyond:
        raise LaunchError(
            f"{host}: slot(s) {beyond} of --include/--exclude or the hostfile, but CUDA_VISIBLE_DEVICES={visible} "
            f"gives this machine {len(ids)} GPU(s) (slots count them from 0)"
        )
    return ",".join(ids[s] for s in slots)


def multi_node(opts: LaunchOptions, resources: Resources, exports: Mapping[str, str]) -> list[NodeCommand]:
    """One torchrun per host of `resources`; the first host is the master unless --master_addr says otherwise."""
    hosts = list(resources)
    master = opts.master_addr or hosts[0]
    commands = []
    for rank, host in enumerate(hosts):
        slots = resources[host]
        env = dict(exports)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "") if is_local_host(host) else ""
        if visible:  # this machine's slot numbers count the GPUs it sees: map them through what it was given
            env["CUDA_VISIBLE_DEVICES"] = _through(visible, slots, host)
        elif slots != list(range(len(slots))):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        argv = [*torchrun_prefix(), "--nproc_per_node", str(len(slots))]
        argv += _rendezvous(opts, len(hosts), rank, master) + _program(opts)
        remote = not is_local_host(host)
        commands.append(NodeCommand(host, rank, len(slots), argv, env, remote=remote, ssh_port=opts.ssh_port))
    return commands


def is_local_host(host: str) -> bool:
    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    return host in names


def exported_environment(environ: Mapping[str, str], cwd: str, home: str) -> dict[str, str]:
    """Variables a remote node needs from here: DeepSpeed's prefixes, plus KEY=VALUE lines of env files
    (`.zeroshard_env`, and `.deepspeed_env` or the file `DS_ENV_FILE` names, as DeepSpeed's runner reads it)."""
    env = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES) or k in EXPORT_NAMES}
    names = (ENV_FILES[0], environ.get("DS_ENV_FILE", ENV_FILES[1]))  # DeepSpeed's DS_ENV_FILE names its file
    for folder in (home, cwd):
        for name in names:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                env.update(read_env_file(path))
    return env


def read_env_file(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise LaunchError(f"{path} line {number}: expected KEY=VALUE, got {line!r}")
            out[key.strip()] = value.strip()
    return out
