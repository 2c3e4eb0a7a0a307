"""Bytes per step, per scope and kind, of an MoE model with expert parallelism against pure ZeRO-3.

    python -m benchmarks.moe_bytes [--out docs/benchmarks_moe.md]

4 gloo ranks acting as 2 nodes x 2 (ZEROSHARD_RANKS_PER_NODE=2, [Note: nodes]) train the parity tests' MoE model
(tests/helpers/moe_parity.py, 4 experts) and count what one step sends ([Note: scopes]):
- `ep2 x dp2, ZeRO-2`: experts split over the 2 ranks of a node (the all-to-all stays inside it), each expert
  data-parallel over the 2 nodes, ZeRO-2 over those 2 ranks; non-expert parameters ZeRO-2 over all 4;
- `ep1, ZeRO-3` (pure ZeRO-3, every rank can run every expert) and `ep1, ZeRO-2` for reference.
Bytes are the ring model's bus bytes per rank (comm/collectives.py); the model is tiny, so the point is where the
bytes go (which scope, which kind), not their size.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VARIANTS = {"ep2 x dp2, ZeRO-2": (2, 2), "ep1, ZeRO-3": (1, 3), "ep1, ZeRO-2": (1, 2)}
WARMUP, MEASURED = 1, 2


def measure(rank: int, world_size: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per variant: scope -> kind -> bus bytes of one step (the mean over MEASURED steps, after WARMUP)."""
    os.environ["ZEROSHARD_RANKS_PER_NODE"] = "2"
    import zeroshard
    from helpers.moe_parity import MoeCase, MoeNet, batch, config
    from zeroshard.comm.topology import init_distributed

    init_distributed()
    out = {}
    for name, (ep_size, stage) in VARIANTS.items():
        case = MoeCase(k=2, stage=stage)
        model = MoeNet(case, ep_size)
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(case))
        for step in range(WARMUP + MEASURED):
            if step == WARMUP:
                engine.comm_stats.reset()
            loss = engine(*batch(case, step, rank))
            engine.backward(loss)
            engine.step()
        snapshot = engine.comm_stats.scope_snapshot()
        out[name] = {
            scope: {kind: entry["bus_bytes"] / MEASURED for kind, entry in kinds.items() if entry["calls"]}
            for scope, kinds in snapshot.items()
        }
        engine.destroy()
    return out


def table(result: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| variant | scope | kind | bus bytes / step / rank |", "|---|---|---|---:|"]
    for name, scopes in result.items():
        for scope, kinds in scopes.items():
            for kind, value in sorted(kinds.items()):
                lines.append(f"| {name} | {scope} | {kind} | {value:,.0f} |")
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
