"""The expert-parallel exchange: tokens to the ranks holding their experts and back, differentiable.

[Note: expert exchange]
Each rank of an expert-parallel group holds `L` of the `E = ep * L` experts (rank j: experts j*L .. j*L+L-1) and
dispatches its tokens into `[E, C, M]` slots, `C` its own capacity. Rank j receives, from every rank i of the
group, `[L, C_i, M]` rows: the capacities are exchanged first (one int per rank), then one all-to-all with uneven
splits moves the rows, and its backward is the same exchange with the splits swapped. Every rank issues the same
collectives whatever the routing, so an expert that got no token on some rank (a zero-token slot, or a zero
capacity) cannot hang the group (DeepSpeed#5066); ranks with different token counts (different capacities) work
too. Received rows are regrouped by local expert: expert l sees `[sum_i C_i, M]` tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.comm.collectives import Collectives


class _Exchange(torch.autograd.Function):
    """Rows of each tensor to their ranks; one autograd node for all of them, so that every rank runs their
    backward exchanges together and in one order (two separate nodes could become ready in a different order on
    ranks whose local graphs differ, e.g. with the experts each rank's tokens hit)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, comm: Collectives, send: list[int], receive: list[int], label: str, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.comm, ctx.send, ctx.receive, ctx.label = comm, send, receive, label
        ctx.rows = [(t.shape[1:], t.dtype, t.device) for t in tensors]
        outs = []
        for index, rows in enumerate(tensors):
            out = rows.new_empty((sum(receive), *rows.shape[1:]))
            comm.all_to_all_uneven(out, rows.contiguous(), receive, send, label=label + (f".{index}" if index else ""))
            outs.append(out)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        outs = []
        for index, (grad, (shape, dtype, device)) in enumerate(zip(grads, ctx.rows, strict=True)):
            if grad is None:  # an output this rank did not use: its senders still expect their rows' gradients
                grad = torch.zeros((sum(ctx.receive), *shape), dtype=dtype, device=device)
            out = grad.new_empty((sum(ctx.send), *shape))
            label = ctx.label + (f".{index}" if index else "") + ".backward"
            ctx.comm.all_to_all_uneven(out, grad.contiguous(), ctx.send, ctx.receive, label=label)
            outs.append(out)
        return (None, None, None, None, *outs)


def exchange(
    comm: Collectives, send: list[int], receive: list[int], label: str, *tensors: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """[Note: expert exchange] `send[j]` rows of each tensor to rank j, `receive[i]` from rank i; differentiable."""
    out = _Exchange.apply(comm, send, receive, label, *tensors)
    return tuple(out)


def exchange_capacities(comm: Collectives, capacity: int, device: torch.device) -> list[int]:
    """Every rank's capacity in the expert-parallel group."""
    mine = torch.tensor([capacity], dtype=torch.int64, device=device)
    everyone = torch.empty(comm.world_size, dtype=torch.int64, device=device)
    comm.all_gather(everyone, mine, label="moe.capacities")
    return [int(c) for c in everyone.tolist()]


def to_experts(dispatched: torch.Tensor, comm: Collectives, capacities: list[int]) -> list[torch.Tensor]:
    """[Note: expert exchange] `dispatched` [E, C, M] -> per local expert its `[sum_i C_i, M]` tokens."""
    ep, (experts, capacity, model) = comm.world_size, dispatched.shape
    local = experts // ep
    send = [local * capacity] * ep
    receive = [local * c for c in capacities]
    (rows,) = exchange(comm, send, receive, "moe.dispatch", dispatched.reshape(experts * capacity, model))
    per_sender = [chunk.reshape(local, c, model) for chunk, c in zip(rows.split(receive), capacities, strict=True)]
    return list(torch.cat(per_sender, dim=1).unbind(0))


def from_experts(outputs: list[torch.Tensor], comm: Collectives, capacities: list[int], capacity: int) -> torch.Tensor:
    """The inverse of `to_experts`: local experts' outputs -> this rank's `[E, C, M]` slots."""
    ep, local, model = comm.world_size, len(outputs), outputs[0].shape[-1]
    stacked = torch.stack([o.reshape(-1, model) for o in outputs])  # [L, sum_i C_i, M]
    per_sender = [chunk.reshape(-1, model) for chunk in stacked.split(capacities, dim=1)]
    send = [local * c for c in capacities]
    receive = [local * capacity] * ep
    (rows,) = exchange(comm, send, receive, "moe.combine", torch.cat(per_sender))
    return rows.reshape(ep * local, capacity, model)
