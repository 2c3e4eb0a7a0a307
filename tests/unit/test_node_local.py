"""[Note: node-local checkpoints]: the pure pieces, without a process group."""

from __future__ import annotations

import pytest

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.node_local import NodeLocal, _without, check_hosts
from zeroshard.comm.topology import NodeLayout


def test_a_node_layout_that_does_not_match_the_hosts_is_refused() -> None:
    placement = NodeLocal(NodeLayout(4, 2), rank=0)
    check_hosts(placement, ["a", "a", "b", "b"])  # torchrun's numbering: node by node
    with pytest.raises(CheckpointError, match=r"ranks 0-1 count as node 0 .* run on hosts \['a', 'b'\]"):
        check_hosts(placement, ["a", "b", "a", "b"])  # a cyclic placement
    with pytest.raises(CheckpointError, match="LOCAL_WORLD_SIZE"):
        check_hosts(NodeLocal(NodeLayout(4, 4), rank=0), ["a", "a", "b", "b"])  # LOCAL_WORLD_SIZE unset: one node


def test_another_leaders_copies_of_whole_tensors_are_dropped_its_shards_kept() -> None:
    leader = {"w": [["model/rank00000.safetensors", 0, 8]], "b": [["model/rank00000.safetensors", 0, 4]]}
    other = {"w": [["model/rank00002.safetensors", 0, 8]], "s": [["model/rank00002.safetensors", 4, 8]]}
    assert _without(other, leader) == {"s": [["model/rank00002.safetensors", 4, 8]]}
