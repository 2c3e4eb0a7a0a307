"""Bytes per step, per scope and kind, of an MoE model with expert parallelism against pure ZeRO-3.

    python -m benchmarks.moe_bytes [--out FILE]   (the table of docs/benchmarks_moe.md)

4 gloo ranks acting as 2 nodes x 2 (ZEROSHARD_RANKS_PER_NODE=2, [Note: nodes]) train the parity tests' MoE model
(tests/helpers/moe_parity.py, 4 experts) and count what one step sends ([Note: scopes]; the counting is
benchmarks/scope_bytes.py's):
- `ep2 x dp2, ZeRO-2`: experts split over the 2 ranks of a node (the all-to-all stays inside it), each expert
  data-parallel over the 2 nodes, ZeRO-2 over those 2 ranks; non-expert parameters ZeRO-2 over all 4;
- `ep1, ZeRO-3` (pure ZeRO-3, every rank can run every expert) and `ep1, ZeRO-2` for reference.
Bytes are the ring model's bus bytes per rank; the model is tiny, so the point is where the bytes go (which scope,
which kind), not their size.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

from benchmarks.scope_bytes import Result, cli, init_nodes, measure_steps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VARIANTS = {"ep2 x dp2, ZeRO-2": (2, 2), "ep1, ZeRO-3": (1, 3), "ep1, ZeRO-2": (1, 2)}


def measure(rank: int, world_size: int) -> Result:
    """Per variant: "source scope" -> kind -> bus bytes of one step (scope_bytes.measure_steps)."""
    scope_of = init_nodes(world_size)
    import zeroshard
    from helpers.moe_parity import MoeCase, MoeNet, config

    out = {}
    for name, (ep_size, stage) in VARIANTS.items():
        case = MoeCase(k=2, stage=stage)
        model = MoeNet(case, ep_size)
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(case))
        out[name] = measure_steps(engine, functools.partial(_step, engine, case, rank), scope_of)
        engine.destroy()
    return out


def _step(engine: Any, case: Any, rank: int, i: int) -> None:
    from helpers.moe_parity import batch

    engine.backward(engine(*batch(case, i, rank)))
    engine.step()


if __name__ == "__main__":
    cli(__doc__.splitlines()[0], measure)
