"""DeepSpeed's `--bind_cores_to_rank` / `--bind_core_list`: each worker of a node on cores of its own.

[Note: binding cores to ranks]
CPU training (and a GPU job's host-side optimizer) runs fastest when each rank's threads stay on their own cores and
memory node instead of being moved by the scheduler between each other's. DeepSpeed's launcher splits the cores
evenly by local rank and runs each worker under `numactl -C <its cores> [-m <their memory node>]`, with
OMP_NUM_THREADS set to the cores per rank. Here each worker's shell runs
`python -S .../launcher/bind.py CORES -- COMMAND` on its own node (a hostfile's remote hosts split their own cores;
this file runs as a script that imports nothing of zeroshard's, whose import would cost each worker seconds),
which takes its share from LOCAL_RANK and LOCAL_WORLD_SIZE (torchrun's), sets OMP_NUM_THREADS, and execs the
command under numactl where the node has it, else with its affinity set (then memory follows the first touch, which
on its own cores is its own node). CORES is
DeepSpeed's `1,3-5,7` list, or `all`: the cores this process may run on, one logical CPU per physical core (DeepSpeed
takes cores 0..physical-1, which a container's cpuset may not hold).
"""

from __future__ import annotations

import glob
import os
import shutil
import sys

ALL = "all"


class CoreListError(ValueError):
    """A core list or core count no worker could be bound by (the launcher turns it into its one line)."""


def parse_core_list(text: str) -> list[int]:
    """DeepSpeed's `--bind_core_list` syntax: `1,3-5,7` -> [1, 3, 4, 5, 7]; as DeepSpeed's, the ranges ascend and do
    not overlap (`0,2-6,5-9` and `1,0` are refused: which core a rank gets would depend on the order)."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            span = range(int(first), int(last) + 1) if dash else range(int(first), int(first) + 1)
        except ValueError:
            raise CoreListError(f"--bind_core_list {text!r}: expected numbers and ranges like 1,3-5,7") from None
        if not span or span.start < 0:
            raise CoreListError(f"--bind_core_list {text!r}: {part.strip()!r} is not a range of core numbers")
        if cores and span.start <= cores[-1]:
            raise CoreListError(
                f"--bind_core_list {text!r}: {part.strip()!r} does not come after core {cores[-1]}; list the cores "
                "in ascending ranges that do not overlap"
            )
        cores += list(span)
    return cores


def available_cores() -> list[int]:
    """The CPUs this process may run on, one per physical core (the first of each core's hyperthreads)."""
    allowed = sorted(os.sched_getaffinity(0))
    kept: list[int] = []
    seen: set[str] = set()
    for cpu in allowed:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as handle:
                siblings = handle.read().strip()
        except OSError:
            siblings = str(cpu)
        if siblings not in seen:
            seen.add(siblings)
            kept.append(cpu)
    return kept


def share(cores: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """Local rank `local_rank`'s equal share of `cores` (what is left over stays unused, as DeepSpeed's)."""
    per_rank = len(cores) // local_world_size
    if per_rank < 1:
        raise CoreListError(
            f"--bind_cores_to_rank: {len(cores)} core(s) ({_ranges(cores)}) for {local_world_size} processes on this "
            "node; give each at least one (fewer --nproc_per_node, or a longer --bind_core_list)"
        )
    return cores[per_rank * local_rank : per_rank * (local_rank + 1)]


def memory_node(cores: list[int]) -> int | None:
    """The NUMA node that holds all of `cores`, if one does."""
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist")):
        with open(path) as handle:
            text = handle.read().strip()
        if text and set(cores) <= set(parse_core_list(text)):
            return int(os.path.basename(os.path.dirname(path))[4:])
    return None


def bound_command(cores: list[int], command: list[str], numactl: str | None) -> list[str]:
    """`command` under numactl on `cores` (and their memory node), or unchanged where there is no numactl."""
    if numactl is None:
        return command
    node = memory_node(cores)
    return [numactl, *(["-m", str(node)] if node is not None else []), "-C", _ranges(cores), *command]


def _ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (numactl's -C syntax)."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and runs[-1][1] + 1 == core:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def main(argv: list[str]) -> None:
    """`python -S bind.py CORES -- COMMAND...`: exec COMMAND on this worker's share of CORES."""
    spec, separator, command = argv[0], argv[1], argv[2:]
    assert separator == "--" and command, argv
    try:
        cores = available_cores() if spec == ALL else parse_core_list(spec)
        outside = sorted(set(cores) - os.sched_getaffinity(0))
        if outside:  # (the launcher checks its own machine before starting; a hostfile's other nodes check here)
            raise CoreListError(
                f"--bind_core_list {spec}: core(s) {outside} are not this node's to run on (it may use "
                f"{sorted(os.sched_getaffinity(0))})"
            )
        mine = share(cores, int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    except CoreListError as error:
        print(f"zeroshard launch: {error}", file=sys.stderr)
        sys.exit(2)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))
    numactl = shutil.which("numactl")
    if numactl is None:
        os.sched_setaffinity(0, mine)
    run = bound_command(mine, command, numactl)
    os.execvp(run[0], run)


if __name__ == "__main__":
    main(sys.argv[1:])
