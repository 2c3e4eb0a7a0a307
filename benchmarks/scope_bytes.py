"""What the `*_bytes` benchmarks share: count one training step's bytes per source, scope and kind, and print them.

    rows = measure_steps(engine, step, scope_of)   # "source scope" -> kind -> bytes per step (this rank)

A step's bytes come from two counters ([Note: scopes] in comm/collectives.py):
- "ZeRO <scope>": zeroshard's Collectives' own counters (`engine.comm_stats`), under the scope its groups were given;
- "DTensor <scope>" and "P2P <scope>": what torch sends past our Collectives, seen by `TorchComm`, a dispatch mode
  (it wraps nothing and patches nothing: every c10d and functional-collective op passes through it). DTensor's
  functional collectives count their ring-model bus bytes; point-to-point `send`/`recv` (torch.distributed.pipelining's
  activations and gradients, whether issued by isend/irecv, batch_isend_irecv or send/recv) count the tensor's bytes.
  The scope of a transfer is read from its group's ranks (both ends of a P2P), not from a label.

Bus bytes are what a rank puts on the wire: a collective over N ranks of S bytes counts S(N-1)/N (twice for an
all-reduce), a send counts its tensor. `recv` rows show what the rank takes off the wire and are left out of totals
(the sender counted them).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Rows = dict[str, dict[str, float]]  # "source scope" -> kind -> bytes per step
Result = dict[str, Rows]  # variant -> rows
ScopeOf = Callable[[list[int]], str]  # global ranks -> "intra_node" | "inter_node"

WARMUP, MEASURED = 1, 2  # the first step infers the pipeline's shapes and builds buffers: not measured
RANKS_PER_NODE = "2"  # 4 ranks act as 2 nodes x 2 ([Note: nodes])
RECV = "recv"
# functional collective -> (kind, ring factor, bytes of the full message S from the arguments and the group size)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 2.0, lambda a, n: _nbytes(a[0])),
    "all_gather_into_tensor": ("all_gather", 1.0, lambda a, n: _nbytes(a[0]) * n),
    "reduce_scatter_tensor": ("reduce_scatter", 1.0, lambda a, n: _nbytes(a[0])),
    "all_to_all_single": ("all_to_all", 1.0, lambda a, n: _nbytes(a[0])),
    "broadcast": ("broadcast", 1.0, lambda a, n: _nbytes(a[0])),
}
_P2P = {"send": "send", "recv_": RECV}  # c10d op -> kind; args: (tensors, process group, peer's group rank, tag)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def init_nodes(world_size: int) -> ScopeOf:
    """Join the gloo group as 2 nodes x 2 and return the scope of a set of global ranks."""
    os.environ["ZEROSHARD_RANKS_PER_NODE"] = RANKS_PER_NODE
    from zeroshard.comm.topology import NodeLayout, init_distributed

    init_distributed()
    nodes = NodeLayout.from_env(world_size)
    return lambda ranks: "inter_node" if nodes.spans_nodes(ranks) else "intra_node"


class TorchComm(TorchDispatchMode):
    """Bytes of the functional collectives (DTensor's) and the point-to-point transfers torch issues, per
    "source scope" and kind. DTensor operators return NotImplemented first so that DTensor desugars them into
    collectives this mode then sees (as torch's CommDebugMode does)."""

    def __init__(self, scope_of: ScopeOf):
        super().__init__()
        self.scope_of = scope_of
        self.rows: Rows = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            self._functional(name, args)
        elif func.namespace == "c10d" and name in _P2P:
            self._p2p(_P2P[name], args)
        return out

    def _functional(self, name: str, args: Sequence[Any]) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(args[-1])
        n = group.size()
        kind, factor, size = _FUNCTIONAL[name]
        self._add("DTensor", dist.get_process_group_ranks(group), kind, factor * size(args, n) * (n - 1) / n)

    def _p2p(self, kind: str, args: Sequence[Any]) -> None:
        import torch.distributed as dist

        tensors, boxed, peer = args[0], args[1], int(args[2])
        group = dist.ProcessGroup.unbox(boxed) if isinstance(boxed, torch.ScriptObject) else boxed
        ends = [dist.get_rank(), dist.get_global_rank(group, peer)]
        self._add("P2P", ends, kind, float(sum(_nbytes(t) for t in tensors)))

    def _add(self, source: str, ranks: list[int], kind: str, value: float) -> None:
        row = self.rows.setdefault(f"{source} {self.scope_of(ranks)}", {})
        row[kind] = row.get(kind, 0.0) + value


def zero_rows(stats: Any) -> Rows:
    """The Collectives' counters (`CommStats`) as rows: "ZeRO <scope>" -> kind -> bus bytes."""
    rows: Rows = {}
    for scope, kinds in stats.scope_snapshot().items():
        for kind, entry in kinds.items():
            if entry["calls"]:
                rows.setdefault(f"ZeRO {scope}", {})[kind] = entry["bus_bytes"]
    return rows


def measure_steps(engine: Any, step: Callable[[int], object], scope_of: ScopeOf) -> Rows:
    """Run `step(i)` WARMUP + MEASURED times on `engine`; the mean bytes of one measured step, both counters."""
    torch_comm = TorchComm(scope_of)
    for i in range(WARMUP + MEASURED):
        if i == WARMUP:
            engine.comm_stats.reset()
        with torch_comm if i >= WARMUP else contextlib.nullcontext():
            step(i)
    rows = zero_rows(engine.comm_stats) | torch_comm.rows
    return {source: {kind: value / MEASURED for kind, value in kinds.items()} for source, kinds in rows.items()}


def table(result: Result) -> str:
    lines = ["| variant | source and scope | kind | bus bytes / step / rank |", "|---|---|---|---:|"]
    for name, rows in result.items():
        total = 0.0
        for source, kinds in sorted(rows.items()):
            for kind, value in sorted(kinds.items()):
                lines.append(f"| {name} | {source} | {kind} | {value:,.0f} |")
                total += 0.0 if kind == RECV else value
        lines.append(f"| {name} | **total** | | **{total:,.0f}** |")
    return "\n".join(lines)


def merge(per_rank: list[Result]) -> Result:
    """Variants of several ranks in one table, in order; a name already there keeps the first rank's rows."""
    out: Result = {}
    for names in itertools.zip_longest(*per_rank):
        for rank_result, name in zip(per_rank, names, strict=True):
            if name is not None and name not in out:
                out[name] = rank_result[name]
    return out


def cli(description: str, measure: Callable[[int, int], Result], ranks: Sequence[int] = (0,)) -> None:
    """`python -m benchmarks.<name> [--out FILE]`: `measure` on 4 ranks, the table of `ranks`' results."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers.harness import run_on_ranks

    results = run_on_ranks(measure, 4)
    text = table(merge([results[r] for r in ranks]))
    if args.out:
        Path(args.out).write_text(text + "\n")
    sys.stdout.write(text + "\n")
