"""Bytes per step, per scope and kind, of tensor parallelism composed with ZeRO against pure ZeRO-3.

    python -m benchmarks.tp_bytes [--out FILE]   (the table of docs/tensor_parallel.md)

4 gloo ranks acting as 2 nodes x 2 (ZEROSHARD_RANKS_PER_NODE=2, [Note: nodes]) train the tensor-parallel parity
tests' Llama-shaped model (tests/helpers/tp_parity.py: hidden 64, 2 layers, vocabulary 128) and count what one
step sends ([Note: scopes]; the counting is benchmarks/scope_bytes.py's):
- `tp2 x dp2, ZeRO-1/2` (ZeRO-2 also with the vocab-parallel loss; ZeRO-3 on the fsdp2 backend, whose
  all-gathers and reduce-scatters our counters count too: fsdp2/comms.py): each layer split over the 2 ranks of
  a node ([Note: tensor-parallel mesh]), ZeRO over the 2 nodes; DTensor's own collectives (the row-parallel all-reduces,
  the gathered logits, ...) are counted by a dispatch mode over torch's functional collectives, ZeRO's by our
  Collectives' counters;
- `dp4, ZeRO-3` (pure ZeRO-3) and `dp4, ZeRO-2` for reference.
Bytes are the ring model's bus bytes per rank; the model is tiny, so the point is where the bytes go, not their size.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

from benchmarks.scope_bytes import Result, cli, init_nodes, measure_steps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VARIANTS = {  # name -> (autotp_size, stage, vocab-parallel loss, backend)
    "tp2 x dp2, ZeRO-1": (2, 1, False, "zero"),
    "tp2 x dp2, ZeRO-2": (2, 2, False, "zero"),
    "tp2 x dp2, ZeRO-2, loss_parallel": (2, 2, True, "zero"),
    "tp2 x dp2, fsdp2 ZeRO-3": (2, 3, False, "fsdp2"),
    "dp4, ZeRO-3": (1, 3, False, "zero"),
    "dp4, ZeRO-2": (1, 2, False, "zero"),
}


def measure(rank: int, world_size: int) -> Result:
    """Per variant: "source scope" -> kind -> bus bytes of one step (scope_bytes.measure_steps)."""
    scope_of = init_nodes(world_size)
    import zeroshard
    from helpers.tp_parity import TpCase, config, llama

    out = {}
    for name, (tp, stage, vocab_parallel, backend) in VARIANTS.items():
        case = TpCase(stage=stage, loss_parallel=vocab_parallel, backend=backend)
        model = llama()
        cfg = config(case, tp)
        engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        out[name] = measure_steps(engine, functools.partial(_step, engine, rank // tp), scope_of)
        engine.destroy()
    return out


def _step(engine: Any, replica: int, i: int) -> None:
    from helpers.tp_parity import batch

    ids = batch(i, replica)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


if __name__ == "__main__":
    cli(__doc__.splitlines()[0], measure)
