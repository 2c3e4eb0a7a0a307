"""`python -m benchmarks.run --preset overhead` (issue 21 item 4): the small-model table plans the rows it says."""

from __future__ import annotations

import pytest

from benchmarks import run
from zeroshard.models.gpt import GPT, PRESETS


def test_overhead_preset_plans_issue_21_shapes() -> None:
    args = run.parse_args(["--preset", "overhead"])
    rows = run.plan(args)
    assert {r.settings.size for r in rows} == {"5m", "20m"}
    assert all(r.settings.micro_batch == 2 and r.settings.timed_steps == 20 and r.world_size == 2 for r in rows)
    assert [r.variant.key for r in rows if r.settings.size == "5m"] == [
        "ddp", "zs0", "ds1", "zs1", "ds2", "zs2", "fsdp2", "ds3", "zs3", "zs3g",
    ]  # fmt: skip
    assert args.seq_len == 0  # each preset's own block: 128 tokens for 5m, 256 for 20m
    assert PRESETS["5m"].block_size == 128 and PRESETS["20m"].block_size == 256
    assert sum(p.numel() for p in GPT(PRESETS["5m"]).parameters()) == 5_289_472


def test_explicit_options_override_the_preset() -> None:
    args = run.parse_args(["--preset=overhead", "--steps", "5", "--sizes", "5m"])
    assert (args.steps, args.sizes, args.micro_batch) == (5, "5m", 2)
    with pytest.raises(SystemExit):
        run.parse_args(["--preset", "nope"])
