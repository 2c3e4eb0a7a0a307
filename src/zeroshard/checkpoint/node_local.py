"""Checkpoints kept on each node's own disk (`checkpoint.use_node_local_storage`, DeepSpeed's key).

[Note: node-local checkpoints]
Without a filesystem that every node sees, each node keeps the files its own ranks read back, as DeepSpeed's
`use_node_local_storage` does (its model-states file is written by each node's local rank 0, its ZeRO files by
every rank). Here:
- the save's start phase checks that every rank counts the same node layout (LOCAL_WORLD_SIZE ranks per node,
  numbered node by node) and that it matches the hosts the ranks run on, and the nodes' leaders (each node's first
  rank) look for one another's marker file in the folder: where all see all, the folder is shared after all and the
  save is an ordinary one; where some nodes share it and others do not, the save is refused;
- every rank writes its shard files into its node's `save_dir` (the same path on every node, or each node its own);
- each leader writes what rank 0 alone writes on a shared filesystem (the tensors no strategy shards, the engine
  state) and, where every rank loads the module weights whole (stages 0-2, `ShardedState.loads_whole`), the whole
  weights once per node: a shared checkpoint spreads those over their owners, whose files would be on other nodes;
  where one rank writes the optimizer state every rank holds (stage 0), each leader writes it too;
- rank 0 merges the ranks' manifests into one metadata.json per node (that node leader's copies of what every leader
  wrote, every rank's own pieces, the save's nonce) and sends each leader its node's; each leader commits its node's
  folder (metadata, rename, `latest`), and every rank hears whether every node committed;
- a load checks, before reading anything, that the folder was saved by this node under the same layout (world size,
  ranks per node) and that every node's folder holds the same save of the tag; each rank reads only its node's files.
The commit is atomic per node, not across nodes: a node whose commit fails after another's succeeded leaves the
nodes' folders with different saves (or tags), and a load names that instead of loading mixed states. Resharding
(another world size) needs the nodes' folders copied into one first: their files together are a complete checkpoint.
The HF Trainer needs `save_on_each_node` (each node's trainer_state.json and rotation); refused otherwise.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from dataclasses import dataclass
from typing import Any

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import METADATA_FILE, CheckpointMetadata
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.checkpoint.state import ModelPiece, ShardedState, StatePart
from zeroshard.checkpoint.sync import RankSync, describe_errors, entry_timeout
from zeroshard.comm.topology import NodeLayout

EXTRA_KEY = "node_local"  # metadata.extra: {"node": n, "ranks_per_node": r, "save": the save's nonce}


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


def model_pieces(part: StatePart, state: ShardedState, placement: NodeLocal | None) -> list[ModelPiece]:
    """The module-weight pieces this rank writes: its own, unless every rank reads the weights back whole (stages
    0-2), where a node's leader writes them whole for its node and the others nothing."""
    if placement is None or not state.loads_whole:
        return part.model_pieces()
    return part.model_targets() if placement.leader else []


def writes_optim(state: ShardedState, placement: NodeLocal | None) -> bool:
    """Whether this rank writes its optimizer pieces: where one rank writes state that every rank holds (stage 0),
    each node's leader writes it too."""
    return state.writes_optim or (placement is not None and placement.leader)


def check_hosts(placement: NodeLocal, hosts: list[str]) -> None:
    """The node layout (LOCAL_WORLD_SIZE ranks per node, numbered node by node) must match where the ranks run: a
    node counted wrong would leave its files uncommitted on a disk no leader of it sees."""
    for node in range(placement.layout.nodes):
        ranks = placement.layout.node_ranks(node)
        seen = sorted({hosts[r] for r in ranks})
        if len(seen) > 1:
            raise CheckpointError(
                f"checkpoint.use_node_local_storage: ranks {ranks[0]}-{ranks[-1]} count as node {node} "
                f"({placement.layout.ranks_per_node} ranks per node, from LOCAL_WORLD_SIZE) but run on hosts "
                f"{seen}; launch the same number of ranks on every node, numbered node by node (torchrun does)"
            )


def settle(
    placement: NodeLocal, sync: RankSync, hello: list[dict[str, Any]], root: str, nonce: str
) -> NodeLocal | None:
    """After a save's start phase: every rank counts the same node layout, which matches the hosts, and where the
    nodes' leaders all see one folder (one filesystem after all) the save is an ordinary one, committed once by rank 0
    (None). Every rank decides from the same gathered values, so all raise or none."""
    per_node = sorted({h["per_node"] for h in hello})
    if len(per_node) > 1:
        raise CheckpointError(
            f"checkpoint.use_node_local_storage: the ranks count {per_node} ranks per node (LOCAL_WORLD_SIZE); "
            "launch the same number of ranks on every node"
        )
    check_hosts(placement, [str(h["fs"]).rsplit(":", 1)[0] for h in hello])
    marker = os.path.join(root, f".node-local.{nonce}.{placement.node}")
    report: dict[str, Any] = {"error": None, "seen": 0}
    try:
        if placement.leader:
            os.makedirs(root, exist_ok=True)
            with open(marker, "w"):
                pass
    except OSError as e:
        report["error"] = f"node {placement.node}: cannot write in {root}: {e.strerror}"
    marked = sync.all_gather("marked", report, entry_timeout())
    if placement.leader and not any(r["error"] for r in marked):
        nodes = range(placement.layout.nodes)
        report["seen"] = sum(os.path.exists(os.path.join(root, f".node-local.{nonce}.{n}")) for n in nodes)
    seen = [r["seen"] for r in sync.all_gather("seen", report, entry_timeout())]
    if placement.leader:
        with contextlib.suppress(OSError):
            os.remove(marker)
    if any(r["error"] for r in marked):
        raise CheckpointError("save_checkpoint: " + describe_errors(marked))
    leaders = [seen[placement.leader_of(n)] for n in range(placement.layout.nodes)]
    if all(count == 1 for count in leaders):
        return placement
    if all(count == placement.layout.nodes for count in leaders):
        return None
    raise CheckpointError(
        f"checkpoint.use_node_local_storage: some nodes share {root} and others do not (the nodes' first ranks see "
        f"{leaders} nodes' markers there); give every node a folder of its own, or one folder all of them see"
    )


def per_node_metadata(
    meta: CheckpointMetadata, manifests: list[dict[str, Any]], layout: NodeLayout, nonce: str
) -> list[str]:
    """metadata.json of each node (index: node), from every rank's manifest: the node leader's copies of what
    every leader wrote, every rank's own pieces; `nonce` identifies the save on every node."""
    from zeroshard.checkpoint.save import complete_metadata

    out = []
    for node in range(layout.nodes):
        leader = layout.node_ranks(node)[0]
        own = manifests[leader]
        kept = []
        for rank, manifest in enumerate(manifests):
            if rank != leader and layout.local_of(rank) == 0:  # another leader: its copies of the node's are not read
                manifest = {**manifest, **{key: _without(manifest[key], own[key]) for key in PIECES}}
                manifest["files"] = {rel: rec for rel, rec in manifest["files"].items() if rel not in own["files"]}
            kept.append(manifest)
        node_meta = complete_metadata(copy.deepcopy(meta), kept)
        node_meta.extra[EXTRA_KEY] = {"node": node, "ranks_per_node": layout.ranks_per_node, "save": nonce}
        out.append(node_meta.to_json())
    return out


PIECES = ("model_pieces", "optim_pieces")


def _without(pieces: dict[str, list[list[Any]]], copies: dict[str, list[list[Any]]]) -> dict[str, list[list[Any]]]:
    """`pieces` less the ranges `copies` holds too (a whole tensor two leaders wrote)."""
    dropped = {(name, ref[1], ref[2]) for name, refs in copies.items() for ref in refs}
    kept = {name: [ref for ref in refs if (name, ref[1], ref[2]) not in dropped] for name, refs in pieces.items()}
    return {name: refs for name, refs in kept.items() if refs}


def saved_by(tag_dir: str | None) -> str | None:
    """The save a node-local checkpoint folder belongs to (its nonce), read before loading: the nodes must agree."""
    if tag_dir is None or not os.path.isfile(os.path.join(tag_dir, METADATA_FILE)):
        return None
    with open(os.path.join(tag_dir, METADATA_FILE), encoding="utf-8") as f:
        extra = json.load(f).get("extra", {}).get(EXTRA_KEY)
    return None if extra is None else str(extra.get("save"))


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
