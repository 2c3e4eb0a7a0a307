"""Checkpoints kept on each node's own disk (`checkpoint.use_node_local_storage`, DeepSpeed's key).

[Note: node-local checkpoints]
Without a filesystem that every node sees, each node keeps the files its own ranks read back, as DeepSpeed's
`use_node_local_storage` does (its model-states file is written by each node's local rank 0, its ZeRO files by
every rank). Here:
- every rank writes its shard files into its node's `save_dir` (the same path on every node, or each node its own);
- each node's first rank (its leader) writes what rank 0 alone writes on a shared filesystem (the tensors no
  strategy shards, the engine state) and, where every rank loads the module weights whole (stages 0-2), the whole
  module weights once per node: a shared checkpoint spreads those over their owners, whose files would then sit on
  other nodes. A rank that reads back only what it wrote (stage 3's shards, the fsdp2 backend's) writes as usual;
- rank 0 merges the ranks' manifests into one metadata.json per node (that node leader's copies of what every
  leader wrote, every rank's shards), each leader commits its node's directory (metadata, rename, `latest`), and
  every rank hears whether every node committed;
- a load checks, before reading anything, that the checkpoint was saved by this node under the same layout (world
  size, ranks per node) and that the nodes resolved the same tag; each rank then reads only its node's files.
The commit is atomic per node, not across nodes: a node whose commit fails after another's succeeded leaves their
`latest` apart, and the next load names the disagreement instead of loading mixed states. Resharding (another world
size) needs the nodes' folders copied into one first: their shard files together are a complete checkpoint.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import CheckpointMetadata
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.checkpoint.state import ModelPiece, StatePart
from zeroshard.comm.topology import NodeLayout

EXTRA_KEY = "node_local"  # metadata.extra: {"node": n, "ranks_per_node": r}


@dataclass(frozen=True)
class NodeLocal:
    """Where this rank's node-local checkpoint files go ([Note: node-local checkpoints])."""

    layout: NodeLayout
    rank: int

    @property
    def node(self) -> int:
        return self.layout.node_of(self.rank)

    @property
    def leader(self) -> bool:
        return self.layout.local_of(self.rank) == 0

    def leader_of(self, node: int) -> int:
        return self.layout.node_ranks(node)[0]


def node_local(engine: CheckpointableEngine) -> NodeLocal | None:
    """This rank's node-local placement, or None when checkpoints go to one shared filesystem."""
    if not engine.config.checkpoint.use_node_local_storage:
        return None
    return NodeLocal(NodeLayout.from_env(engine.topology.world_size), engine.topology.rank)


def writes_shared(engine: CheckpointableEngine) -> bool:
    """Whether this rank writes the files rank 0 writes for everybody (on each node its leader, node-local)."""
    placement = node_local(engine)
    return engine.topology.rank == 0 if placement is None else placement.leader


def model_pieces(part: StatePart, placement: NodeLocal | None) -> list[ModelPiece]:
    """The module-weight pieces this rank writes: its own, unless it reads back more than them (stages 0-2 load the
    weights whole), where a node's leader writes the whole weights for the node and the others nothing."""
    saved = part.model_pieces()
    if placement is None:
        return saved
    targets = part.model_targets()
    if all(any(s.name == t.name and s.begin <= t.begin and t.end <= s.end for s in saved) for t in targets):
        return saved
    return targets if placement.leader else []


def per_node_metadata(meta: CheckpointMetadata, manifests: list[dict[str, Any]], layout: NodeLayout) -> list[str]:
    """metadata.json of each node (index: node), from every rank's manifest: the node leader's copies of what
    every leader wrote, every rank's own pieces."""
    from zeroshard.checkpoint.save import complete_metadata

    out = []
    for node in range(layout.nodes):
        leader = layout.node_ranks(node)[0]
        own = manifests[leader]
        copies = {(name, ref[1], ref[2]) for name, refs in own["model_pieces"].items() for ref in refs}
        kept = []
        for rank, manifest in enumerate(manifests):
            if rank != leader and layout.local_of(rank) == 0:  # another leader: its copies of the node's are not read
                pieces = {
                    name: [ref for ref in refs if (name, ref[1], ref[2]) not in copies]
                    for name, refs in manifest["model_pieces"].items()
                }
                files = {rel: record for rel, record in manifest["files"].items() if rel not in own["files"]}
                manifest = {**manifest, "model_pieces": {n: r for n, r in pieces.items() if r}, "files": files}
            kept.append(manifest)
        node_meta = complete_metadata(copy.deepcopy(meta), kept)
        node_meta.extra[EXTRA_KEY] = {"node": node, "ranks_per_node": layout.ranks_per_node}
        out.append(node_meta.to_json())
    return out


def check_loadable(meta: CheckpointMetadata, tag_dir: str, engine: CheckpointableEngine) -> None:
    """Loading with node-local storage: the checkpoint must be this node's, saved under this layout, so that every
    rank finds its files on its node. (Without the key a node-local checkpoint loads from a folder the nodes' folders
    were copied into, at any world size.)"""
    if node_local(engine) is None:
        return
    saved = meta.extra.get(EXTRA_KEY)
    if saved is None:  # a checkpoint of a shared folder: whoever sees the folder reads it
        return
    layout = NodeLayout.from_env(engine.topology.world_size)
    here = (engine.topology.world_size, layout.ranks_per_node, layout.node_of(engine.topology.rank))
    there = (meta.world_size, int(saved["ranks_per_node"]), int(saved["node"]))
    if here != there:
        raise CheckpointError(
            f"{tag_dir}: saved with checkpoint.use_node_local_storage by node {there[2]} of {there[0]} ranks in nodes "
            f"of {there[1]}; this rank is on node {here[2]} of {here[0]} ranks in nodes of {here[1]}, and its files "
            "are on the saving node's disk: resume with the saving layout, or copy every node's folder into one "
            "and load it with use_node_local_storage false"
        )
