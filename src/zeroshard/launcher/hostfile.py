"""Hostfiles in DeepSpeed's format and the --include/--exclude resource filters. Pure functions.

A hostfile lists one host per line, `HOST slots=N`; `#` starts a comment; blank lines are skipped:

    # two nodes with 8 GPUs each
    worker-0 slots=8
    worker-1 slots=8

A filter names hosts separated by `@`, each optionally followed by `:` and slot indices:
`--include "worker-0@worker-1:0,2"` keeps all of worker-0 and slots 0 and 2 of worker-1;
`--exclude "worker-1:0"` drops slot 0 of worker-1 (a host without slots is dropped whole, as is a `slots=0` host).
"""

from __future__ import annotations

import os
import re

from zeroshard.errors import ZeroshardError

Resources = dict[str, list[int]]  # host -> slot indices (GPU ids), in hostfile order

# (MPI hostfiles add `max_slots=N`, `max-slots=N` and the like after the slots: read past, as DeepSpeed's parser reads
# past anything there)
_LINE = re.compile(r"^(?P<host>\S+)\s+slots\s*=\s*(?P<slots>\S+)(?:\s.*)?$")


class LaunchError(ZeroshardError):
    """A hostfile, resource filter or launch option is wrong; the message says where and what to do."""


def read_hostfile(path: str | os.PathLike[str]) -> dict[str, int]:
    """Hosts and slot counts of a hostfile, in file order."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as err:
        raise LaunchError(f"hostfile {name} cannot be read: {err.strerror or err}") from None
    return parse_hostfile(text, name)


def parse_hostfile(text: str, source: str = "<hostfile>") -> dict[str, int]:
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise LaunchError(f"hostfile {source} line {number}: expected 'HOST slots=N', got {raw.strip()!r}")
        host, slots_text = match["host"], match["slots"]
        if not slots_text.isdigit():  # slots=0 keeps a host listed but out of the launch, as DeepSpeed drops it
            raise LaunchError(f"hostfile {source} line {number}: slots={slots_text} must be a whole number")
        if host in hosts:
            raise LaunchError(
                f"hostfile {source} line {number}: host {host} is listed twice (first on line {first_line[host]})"
            )
        hosts[host], first_line[host] = int(slots_text), number
    if not hosts:
        raise LaunchError(f"hostfile {source} lists no hosts; write one 'HOST slots=N' per line")
    return hosts


def parse_filter(spec: str, option: str) -> dict[str, list[int] | None]:
    """`host1@host2:0,2` -> {host1: None (all slots), host2: [0, 2]}. A host named twice has the union of its slots,
    as DeepSpeed merges them (`w:0@w:1` is `w:0,1`; `w:1@w` is `w:1`: a bare name adds no slot)."""
    merged: dict[str, list[int]] = {}
    for part in spec.split("@"):
        host, sep, slots_text = part.strip().partition(":")
        if not host:
            raise LaunchError(f"{option} {spec!r}: empty host name; the form is HOST[:SLOT,SLOT]@HOST...")
        merged.setdefault(host, [])
        if not sep:
            continue
        try:
            slots = [int(s) for s in slots_text.split(",") if s.strip()]
        except ValueError:
            raise LaunchError(f"{option} {spec!r}: slots of {host} must be integers, e.g. {host}:0,1") from None
        if not slots:
            raise LaunchError(f"{option} {spec!r}: no slots after '{host}:'")
        merged[host] += slots
    return {host: sorted(set(slots)) or None for host, slots in merged.items()}


def select_resources(hosts: dict[str, int], include: str | None = None, exclude: str | None = None) -> Resources:
    """Apply DeepSpeed's --include/--exclude semantics to the hostfile's hosts."""
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be used together")
    resources: Resources = {host: list(range(slots)) for host, slots in hosts.items()}
    if not include and not exclude:
        return _with_slots(resources, "the hostfile")
    option = "--include" if include else "--exclude"
    wanted = parse_filter(include or exclude or "", option)
    for host, slots in wanted.items():
        if host not in resources:
            raise LaunchError(f"{option}: host {host} is not in the hostfile ({', '.join(resources)})")
        bad = [s for s in slots or [] if s not in resources[host]]
        if bad:
            held = f"slots 0-{hosts[host] - 1}" if hosts[host] else "no slots (slots=0)"
            raise LaunchError(f"{option}: {host} has {held}, not {bad}")
    if include:
        chosen = {h: list(wanted[h] or resources[h]) for h in resources if h in wanted}
        return _with_slots(chosen, f"--include {include!r}")
    kept: Resources = {}
    for host, slots in resources.items():
        dropped = wanted.get(host, [])
        if host in wanted and dropped is None:
            continue
        remaining = [s for s in slots if s not in (dropped or [])]
        if remaining:
            kept[host] = remaining
    if not kept:
        raise LaunchError(f"--exclude {exclude!r} leaves no slots to run on")
    return kept


def _with_slots(resources: Resources, source: str) -> Resources:
    """The hosts that have slots (a `slots=0` host is left out, as DeepSpeed removes hosts without slots)."""
    kept = {host: slots for host, slots in resources.items() if slots}
    if not kept:
        raise LaunchError(f"{source} leaves no slots to run on (every host has slots=0)")
    return kept


def limit_resources(resources: Resources, nnodes: int | None, nproc_per_node: int | None) -> Resources:
    """The first `nnodes` hosts, and the first `nproc_per_node` slots of each (DeepSpeed's --num_nodes/--num_gpus)."""
    hosts = list(resources)
    if nnodes is not None:
        if nnodes > len(hosts):
            raise LaunchError(f"--nnodes {nnodes} but the hostfile has {len(hosts)} usable host(s)")
        hosts = hosts[:nnodes]
    out: Resources = {}
    for host in hosts:
        slots = resources[host]
        if nproc_per_node is not None:
            if nproc_per_node > len(slots):
                raise LaunchError(f"--nproc_per_node {nproc_per_node} but {host} has {len(slots)} usable slot(s)")
            slots = slots[:nproc_per_node]
        out[host] = slots
    return out
