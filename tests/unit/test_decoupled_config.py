"""`checkpoint.writer` ([Note: decoupled checkpoint writes]): which saves are decoupled, what is refused or warned."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from helpers.config_checks import warnings_of
from zeroshard.checkpoint.decoupled import decoupled, failing
from zeroshard.config import parse_config
from zeroshard.errors import ConfigError


def _engine(writer: dict | None, per_stage: bool = False, **zero: object) -> SimpleNamespace:
    raw: dict = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, **zero}}
    if writer is not None:
        raw["checkpoint"] = {"writer": writer}
    return SimpleNamespace(config=parse_config(raw), _saves_per_stage=per_stage)


def test_which_engines_save_decoupled(log: pytest.LogCaptureFixture) -> None:
    assert not decoupled(_engine(None))
    assert not decoupled(_engine({"decoupled": False}))
    assert decoupled(_engine({"decoupled": True}))
    assert decoupled(_engine({"decoupled": True}, offload_optimizer={"device": "cpu"}))
    swapped = _engine({"decoupled": True}, offload_optimizer={"device": "nvme", "nvme_path": "/tmp"})
    assert not decoupled(swapped) and not decoupled(swapped)
    said = [r.getMessage() for r in log.records if "checkpoint.writer.decoupled" in r.getMessage()]
    assert said == [
        "checkpoint.writer.decoupled: saves are written before save_checkpoint returns (offload_optimizer on NVMe)"
    ]  # once per engine
    assert not decoupled(_engine({"decoupled": True}, per_stage=True))
    stage2 = _engine({"decoupled": True}, stage=2, offload_param={"device": "nvme", "nvme_path": "/tmp"})
    assert decoupled(stage2)  # offload_param is ignored below stage 3: nothing is swapped


def test_the_mock_writer_is_refused_and_the_aio_knobs_are_warned(log: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match='checkpoint.writer.type "MOCK"'):
        parse_config({"checkpoint": {"writer": {"type": "mock"}}})
    parse_config({"checkpoint": {"writer": {"type": "python", "decoupled": True, "io_buffer_size": 1 << 20}}})
    warned = warnings_of(log)
    assert warned == [
        "zeroshard: checkpoint.writer.io_buffer_size=1048576 is accepted but not implemented yet; it has no effect"
    ], warned


def test_which_exits_count_as_failing() -> None:
    """Given up rather than committed: an exception being handled, unless it is the one the save was made under (an
    emergency save in an `except` block), and a non-zero SystemExit."""
    assert not failing()
    try:
        raise RuntimeError("boom")
    except RuntimeError as during:
        assert failing()
        assert not failing(during)
    for code, expected in ((0, False), (None, False), (1, True)):
        try:
            raise SystemExit(code)
        except SystemExit:
            assert failing() == expected, code


def test_resume_true_takes_the_newest_committed_checkpoint(tmp_path, log: pytest.LogCaptureFixture) -> None:
    """`Trainer.train(resume_from_checkpoint=True)`: a run that stopped during a decoupled save left a newer
    `checkpoint-N` with no `latest`; the newest committed one is resumed from, and a warning names both."""
    from zeroshard.hf.trainer import newest_committed

    assert newest_committed(str(tmp_path / "absent")) is None
    assert newest_committed(str(tmp_path)) is None  # no checkpoint at all: transformers says so
    for step, committed in ((2, True), (10, True), (12, False)):
        folder = tmp_path / f"checkpoint-{step}"
        (folder / f".tmp.global_step{step}.abc").mkdir(parents=True)
        if committed:
            (folder / "latest").write_text(f"global_step{step}")
    assert newest_committed(str(tmp_path)) == str(tmp_path / "checkpoint-10")  # 10 > 2: by number, not by name
    said = [r.getMessage() for r in log.records if "resume_from_checkpoint=True" in r.getMessage()]
    assert len(said) == 1 and "checkpoint-12 holds no committed" in said[0] and "checkpoint-10" in said[0], said
    # the saving process sets it aside, so that save_total_limit cannot keep it in place of committed ones
    assert newest_committed(str(tmp_path), set_aside=True) == str(tmp_path / "checkpoint-10")
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-2", "uncommitted-checkpoint-12"]
    assert newest_committed(str(tmp_path)) == str(tmp_path / "checkpoint-10")  # committed: no warning
    (tmp_path / "checkpoint-11").mkdir()
    for step in (2, 10):
        (tmp_path / f"checkpoint-{step}" / "latest").unlink()
    assert newest_committed(str(tmp_path)) is None  # none committed: transformers' newest, which fails by name
