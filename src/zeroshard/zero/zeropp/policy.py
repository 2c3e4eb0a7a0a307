"""What ZeRO++ does, from DeepSpeed's three keys, and the groups it talks over.

[Note: ZeRO++]
Three independent switches, each usable alone or with the others (stage 3):
- qwZ, `zero_quantized_weights`: the forward (and, without hpZ, backward) all-gather of a unit sends its shards as
  8-bit codes with one fp32 scale per block ([Note: block quantization] in zero/quant.py), 0.254x of fp32's bytes;
  every rank, its own shard included, computes with the dequantized values, so all replicas hold the same weights
  and backward sees exactly forward's. The fp32 master, the compute shard and the optimizer step are untouched.
- hpZ, `zero_hpz_partition_size` = H > 1: each unit also keeps a secondary shard of 1/H of its full buffer
  (compute dtype), partitioned over consecutive blocks of H ranks (one node when H = ranks per node). It is filled
  from the forward gather's result (a copy, no communication), and backward gathers from it within the block,
  so with H dividing the node no backward gather byte leaves the node. Cost: numel/H compute-dtype elements per
  unit per rank (`memory_report().secondary_params`). Every gather of a unit after its first since the root
  forward began (backward, prefetches for backward issued during forward, recompute) uses the secondary; a unit
  not gathered in this forward gathers as usual. Unlike DeepSpeed, the secondary is kept in the compute dtype,
  not int8: the backward all-gather is intra-node, and backward then uses the very values forward did.
- Gathers that hand parameters to the user (state_dict, GatheredParameters, consolidation) are never quantized.
- qgZ, `zero_quantized_gradients`: a unit's gradients are reduce-scattered in two all-to-all hops, first within
  the node (each rank receives, quantized, the chunks every node's rank with its local index owns, and sums them),
  then between nodes among the ranks with the same local index (quantized partial sums, summed into this rank's
  shard). Only 1/(ranks per node) of the gradient crosses nodes, at 8 bits. Sums are formed in fp32. DeepSpeed
  applies qgZ at stage 3 only (its stage3.py), and so does zeroshard: at stages 1-2 the key is ignored with a
  warning. DeepSpeed's kernels send 4-bit codes; zeroshard sends 8-bit codes (plain torch ops have no int4 type).
qwZ's gathers overlap as plain ones do (overlap_comm; the dequantize runs when the gather is waited on); qgZ's two
hops run to completion before the reduction returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroshard.comm.collectives import Collectives, Scope
from zeroshard.comm.topology import NodeLayout, new_group
from zeroshard.errors import ConfigError
from zeroshard.zero.quant import BlockQuantizer


@dataclass(frozen=True)
class ZeroPPPolicy:
    """DeepSpeed's keys, the node layout, and the quantizer ([Note: ZeRO++])."""

    quantized_weights: bool = False
    hpz_partition_size: int = 1
    quantized_gradients: bool = False
    # held, not communicated: [Note: quantized frozen weights] in zero/stage3/packed.py (also at one rank)
    quantized_nontrainable_weights: bool = False
    nodes: NodeLayout | None = None  # None: one node holding every rank
    quantizer: BlockQuantizer = field(default_factory=BlockQuantizer)

    @property
    def hpz(self) -> bool:
        return self.hpz_partition_size > 1

    @property
    def frozen_quantizer(self) -> BlockQuantizer | None:
        return self.quantizer if self.quantized_nontrainable_weights else None

    @property
    def enabled(self) -> bool:
        """Whether any gather or reduction changes (the collectives ZeRO++'s groups serve)."""
        return self.quantized_weights or self.hpz or self.quantized_gradients


@dataclass
class ZeroPPGroups:
    """The sub-group collectives ZeRO++ uses on this rank, counted in the world's stats under their scope."""

    layout: NodeLayout
    node: Collectives  # the ranks of this rank's node (qgZ hop 1)
    peers: Collectives  # one rank per node, this rank's local index (qgZ hop 2)
    hpz: Collectives | None  # this rank's hpZ partition block


def build_groups(comm: Collectives, policy: ZeroPPPolicy) -> ZeroPPGroups:
    """Create the groups (every rank calls this, in the same order: process-group creation is collective)."""
    layout = policy.nodes or NodeLayout(comm.world_size, comm.world_size)
    rank, per_node = comm.rank, layout.ranks_per_node
    node = _group(comm, layout, [layout.node_ranks(n) for n in range(layout.nodes)], rank)
    peers = _group(comm, layout, [layout.peer_ranks(local) for local in range(per_node)], rank)
    hpz = None
    if policy.hpz:
        size = policy.hpz_partition_size
        if comm.world_size % size:
            raise ConfigError(
                f"zero_optimization.zero_hpz_partition_size {size} does not divide the {comm.world_size} ranks"
            )
        hpz = node if size == per_node else _group(comm, layout, layout.blocks(size), rank)
    return ZeroPPGroups(layout, node, peers, hpz)


def _group(comm: Collectives, layout: NodeLayout, blocks: list[list[int]], rank: int) -> Collectives:
    """Collectives over the block that holds `rank` (the world's own, or a lone rank's, without a new group)."""
    mine = next(b for b in blocks if rank in b)
    scope = Scope.INTER_NODE if layout.spans_nodes(mine) else Scope.INTRA_NODE
    if len(mine) == comm.world_size:
        return comm.subgroup(comm.group, comm.world_size, comm.rank, scope)
    if len(mine) == 1:
        return comm.subgroup(None, 1, 0, scope)
    made = {tuple(b): new_group(b) for b in blocks}
    return comm.subgroup(made[tuple(mine)], len(mine), mine.index(rank), scope)
