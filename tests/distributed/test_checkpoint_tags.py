"""`checkpoint.tag_validation` with a different tag per rank (DeepSpeed's
`tests/unit/checkpoint/test_tag_validation.py`): FAIL refuses on every rank and writes nothing, WARN writes rank 0's
tag."""

from __future__ import annotations

import os
from typing import Any

from helpers.harness import run_on_ranks
from helpers.parity import Case, build_model, ds_config, param_groups


def _tags(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import zeroshard
    from zeroshard.checkpoint.errors import CheckpointError

    out: dict[str, Any] = {}
    for mode in ("FAIL", "WARN"):
        case = Case(stage=1)
        model = build_model(case)
        config = {**ds_config(case), "checkpoint": {"tag_validation": mode}}
        engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=config)
        folder = os.path.join(root, mode)
        try:
            engine.save_checkpoint(folder, tag=f"tag-{rank}")
            out[mode] = "saved"
        except CheckpointError as error:
            out[mode] = str(error)
        engine.destroy()
        out[mode + "_files"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return out


def test_different_tags_fail_on_every_rank_and_write_nothing_or_warn_and_use_rank_0s(tmp_path) -> None:
    for out in run_on_ranks(_tags, 2, str(tmp_path)):
        assert out["FAIL"] == (
            "save_checkpoint: ranks passed different tags ['tag-0', 'tag-1']; nothing was saved "
            "(checkpoint.tag_validation is FAIL): pass every rank the same tag"
        ), out
        assert out["FAIL_files"] == [], out
        assert out["WARN"] == "saved" and "tag-0" in out["WARN_files"] and "tag-1" not in out["WARN_files"], out
