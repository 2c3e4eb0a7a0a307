"""Checkpoint rendezvous on a store, without processes ([Note: one-rank checkpoint calls])."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.sync import RankSync, phase_key


def test_a_rank_arriving_after_the_others_gave_up_on_it_fails_at_once():
    """[Note: one-rank checkpoint calls]: its arrival was taken as absent; waiting would hang."""
    store = dist.HashStore()
    store.set(phase_key(1, "save_checkpoint", "start", 1), json.dumps({"absent": "in engine.step (step 3)"}))
    with pytest.raises(CheckpointError, match="the other ranks stopped waiting for this rank .1.*GRACE"):
        RankSync("save_checkpoint", 1, 2, store).all_gather("start", {"tag": "t"}, timeout=1)
