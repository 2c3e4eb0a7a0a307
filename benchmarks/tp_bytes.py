"""Bytes per step, per scope and kind, of tensor parallelism composed with ZeRO against pure ZeRO-3.

    python -m benchmarks.tp_bytes [--out FILE]   (the table of docs/tensor_parallel.md)

4 gloo ranks acting as 2 nodes x 2 (ZEROSHARD_RANKS_PER_NODE=2, [Note: nodes]) train the tensor-parallel parity
tests' Llama-shaped model (tests/helpers/tp_parity.py: hidden 64, 2 layers, vocabulary 128) and count what one
step sends ([Note: scopes]):
- `tp2 x dp2, ZeRO-1/2` (ZeRO-2 also with the vocab-parallel loss; ZeRO-3 on the fsdp2 backend, whose
  all-gathers and reduce-scatters our counters count too: fsdp2/comms.py): each layer split over the 2 ranks of
  a node ([Note: tensor-parallel mesh]), ZeRO over the 2 nodes; DTensor's own collectives (the row-parallel all-reduces,
  the gathered logits, ...) are counted by a dispatch mode over torch's functional collectives (`DTensorComm`),
  ZeRO's by our Collectives' counters;
- `dp4, ZeRO-3` (pure ZeRO-3) and `dp4, ZeRO-2` for reference.
Bytes are the ring model's bus bytes per rank (comm/collectives.py; a collective over N ranks of S bytes counts
S(N-1)/N, twice for an all-reduce); the model is tiny, so the point is where the bytes go, not their size.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VARIANTS = {  # name -> (autotp_size, stage, vocab-parallel loss, backend)
    "tp2 x dp2, ZeRO-1": (2, 1, False, "zero"),
    "tp2 x dp2, ZeRO-2": (2, 2, False, "zero"),
    "tp2 x dp2, ZeRO-2, loss_parallel": (2, 2, True, "zero"),
    "tp2 x dp2, fsdp2 ZeRO-3": (2, 3, False, "fsdp2"),
    "dp4, ZeRO-3": (1, 3, False, "zero"),
    "dp4, ZeRO-2": (1, 2, False, "zero"),
}
WARMUP, MEASURED = 1, 2
# functional collective -> (kind, ring factor, bytes of the full message S from the arguments and the group size)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 2.0, lambda a, n: _nbytes(a[0])),
    "all_gather_into_tensor": ("all_gather", 1.0, lambda a, n: _nbytes(a[0]) * n),
    "reduce_scatter_tensor": ("reduce_scatter", 1.0, lambda a, n: _nbytes(a[0])),
    "all_to_all_single": ("all_to_all", 1.0, lambda a, n: _nbytes(a[0])),
    "broadcast": ("broadcast", 1.0, lambda a, n: _nbytes(a[0])),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DTensorComm(TorchDispatchMode):
    """Ring-model bus bytes of the functional collectives DTensor issues, per (scope, kind). DTensor operators
    return NotImplemented first so that DTensor desugars them into collectives this mode then sees (as torch's
    CommDebugMode does)."""

    def __init__(self, scope_of_group: Any):
        super().__init__()
        self.scope_of_group = scope_of_group
        self.bytes: dict[str, dict[str, float]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            from torch.distributed.distributed_c10d import _resolve_process_group

            group = _resolve_process_group(args[-1])
            n = group.size()
            kind, factor, size = _FUNCTIONAL[name]
            scope = self.bytes.setdefault(self.scope_of_group(group), {})
            scope[kind] = scope.get(kind, 0.0) + factor * size(args, n) * (n - 1) / n
        return out


def measure(rank: int, world_size: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per variant: "source scope" -> kind -> bus bytes of one step (the mean over MEASURED steps, after WARMUP)."""
    os.environ["ZEROSHARD_RANKS_PER_NODE"] = "2"
    import torch.distributed as dist

    import zeroshard
    from helpers.tp_parity import TpCase, batch, config, llama
    from zeroshard.comm.topology import NodeLayout, init_distributed

    init_distributed()
    nodes = NodeLayout.from_env(world_size)

    def scope_of(group: Any) -> str:
        return "inter_node" if nodes.spans_nodes(dist.get_process_group_ranks(group)) else "intra_node"

    out = {}
    for name, (tp, stage, vocab_parallel, backend) in VARIANTS.items():
        case = TpCase(stage=stage, loss_parallel=vocab_parallel, backend=backend)
        model = llama()
        cfg = config(case, tp)
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        dtensor = DTensorComm(scope_of)
        for step in range(WARMUP + MEASURED):
            if step == WARMUP:
                engine.comm_stats.reset()
            ids = batch(step, rank // tp)
            with dtensor if step >= WARMUP else contextlib.nullcontext():  # the step itself issues no DTensor op
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
            engine.step()
        rows: dict[str, dict[str, float]] = {}
        for scope, kinds in engine.comm_stats.scope_snapshot().items():
            for kind, entry in kinds.items():
                if entry["calls"]:
                    rows.setdefault(f"ZeRO {scope}", {})[kind] = entry["bus_bytes"] / MEASURED
        for scope, kinds in dtensor.bytes.items():
            rows[f"DTensor {scope}"] = {kind: value / MEASURED for kind, value in kinds.items()}
        out[name] = rows
        engine.destroy()
    return out


def table(result: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| variant | source and scope | kind | bus bytes / step / rank |", "|---|---|---|---:|"]
    for name, scopes in result.items():
        total = 0.0
        for scope, kinds in sorted(scopes.items()):
            for kind, value in sorted(kinds.items()):
                lines.append(f"| {name} | {scope} | {kind} | {value:,.0f} |")
                total += value
        lines.append(f"| {name} | **total** | | **{total:,.0f}** |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args()
    from helpers.harness import run_on_ranks

    result = run_on_ranks(measure, 4)[0]
    text = table(result)
    if args.out:
        Path(args.out).write_text(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
