"""benchmarks/scope_bytes.py counts point-to-point bytes exactly: known transfers on 2 gloo ranks, each its own node.

Raw transfers by every route torch offers (isend/irecv, batch_isend_irecv, send/recv) and a 2-stage pipeline's
step (pp2, 1F1B over 4 micro-batches of 2 x 16 float32: 4 x 128 bytes of activations one way, as many gradients
the other), measured after the warm-up step that infers the pipeline's shapes.
"""

from __future__ import annotations

from typing import Any

from helpers.harness import run_on_ranks

FLOATS, PAIRS, DOUBLES = 1000, 3, 7  # rank 0 -> 1 by isend; both ways by batch_isend_irecv; 0 -> 1 by send


def _raw(rank: int, peer: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    from benchmarks.scope_bytes import TorchComm

    counter = TorchComm(lambda ranks: "inter_node" if len(set(ranks)) > 1 else "intra_node")
    with counter:
        one_way = torch.ones(FLOATS)
        work = dist.isend(one_way, peer) if rank == 0 else dist.irecv(one_way, peer)
        assert work is not None
        work.wait()
        ops = [dist.P2POp(dist.isend, torch.ones(PAIRS, dtype=torch.int64), peer)]
        ops.append(dist.P2POp(dist.irecv, torch.zeros(PAIRS, dtype=torch.int64), peer))
        for pending in dist.batch_isend_irecv(ops):
            pending.wait()
        doubles = torch.ones(DOUBLES, dtype=torch.float64)
        dist.send(doubles, peer) if rank == 0 else dist.recv(doubles, peer)
        dist.all_reduce(torch.ones(5))  # a collective, not a P2P: ZeRO's counters count ours, not this mode
    return counter.rows


def _pipeline() -> dict[str, dict[str, float]]:
    from benchmarks.scope_bytes import measure_steps
    from helpers.pipeline import PipeCase, build, replica_iter

    case = PipeCase(2, "1f1b", zero=1, steps=3)
    engine = build(case)
    data = replica_iter(case, 1, 0, range(case.steps))
    rows = measure_steps(engine, lambda _: engine.train_batch(data_iter=data), lambda _: "inter_node")
    engine.destroy()
    return rows


def _count(rank: int, world_size: int) -> dict[str, Any]:
    from zeroshard.comm.topology import init_distributed

    init_distributed()
    return {"raw": _raw(rank, 1 - rank), "pipeline": _pipeline()}


def test_p2p_bytes_are_counted_exactly() -> None:
    from helpers.pipeline import WIDTH, PipeCase

    results = run_on_ranks(_count, 2, timeout=120)
    sent = FLOATS * 4 + PAIRS * 8 + DOUBLES * 8  # what rank 0 sends
    assert results[0]["raw"] == {"P2P inter_node": {"send": sent, "recv": PAIRS * 8}}
    assert results[1]["raw"] == {"P2P inter_node": {"send": PAIRS * 8, "recv": sent}}
    case = PipeCase(2)
    per_direction = case.gas * case.micro * WIDTH * 4  # micro-batches x activation bytes
    for rank in (0, 1):
        assert results[rank]["pipeline"]["P2P inter_node"] == {"send": per_direction, "recv": per_direction}
        assert any(source.startswith("ZeRO") for source in results[rank]["pipeline"])
