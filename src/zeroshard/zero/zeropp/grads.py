"""qgZ: a unit's gradients reduce-scattered by two quantized all-to-all hops ([Note: ZeRO++] in policy.py).

Ranks are numbered node by node: rank r = node * L + local (L ranks per node, M nodes), and rank r owns chunk r
of the S-element buffer (S = M * L * s). Hop 1, within the node: to local peer j this rank sends, packed, the
chunks of every node's rank j (M * s elements), and sums what its L peers send it: the node's partial sums of the
chunks its counterparts own. Hop 2, between nodes, among the M ranks with this local index: to node n it sends
the partial sum of chunk n * L + local, and sums the M pieces it gets: the full sum of its own chunk. Per rank,
S * (L-1)/L elements move inside the node and S * (M-1)/(M*L) between nodes, at 1 + 4/block bytes each.
"""

from __future__ import annotations

import torch

from zeroshard.comm.collectives import Collectives, Handle
from zeroshard.zero.quant import BlockQuantizer
from zeroshard.zero.zeropp.policy import ZeroPPGroups


class QuantizedReduceScatter:
    """Called as `comm.reduce_scatter(output, input, async_op=..., label=...)`; runs to completion (synchronous)."""

    def __init__(self, groups: ZeroPPGroups, quantizer: BlockQuantizer):
        self.groups = groups
        self.quantizer = quantizer

    def __call__(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, label: str = "") -> Handle:
        layout, shard = self.groups.layout, output.numel()
        chunks = input.view(layout.nodes, layout.ranks_per_node, shard).transpose(0, 1)  # [local peer][node]
        partial = self._hop(self.groups.node, chunks.reshape(layout.ranks_per_node, -1), f"qgZ intra {label}")
        total = self._hop(self.groups.peers, partial.view(layout.nodes, shard), f"qgZ inter {label}")
        output.copy_(total)
        return _DONE

    def _hop(self, comm: Collectives, rows: torch.Tensor, label: str) -> torch.Tensor:
        """Row j goes to rank j of `comm`; returns the fp32 sum of the rows this rank receives."""
        if comm.world_size == 1:
            return rows[0].float()
        quantizer, numel = self.quantizer, rows.shape[1]
        width = quantizer.packed_bytes(numel)
        send = torch.empty(comm.world_size, width, dtype=torch.uint8, device=rows.device)
        quantizer.pack(rows, send)
        received = torch.empty_like(send)
        comm.all_to_all(received.view(-1), send.view(-1), label=label)
        return quantizer.unpack(received, numel).sum(dim=0)


class _Done:
    def wait(self, timeout: object = None) -> bool:
        return True


_DONE = _Done()
