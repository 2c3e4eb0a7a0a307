"""A save folder's own names and a write's failures, said in one line (the checkpoint probe): a tag named `latest`,
`latest_universal` or `zero_to_fp32.py` replaced the folder's pointer or script with itself, and the error said
"nothing was committed" after the commit; a failed write other than a full disk named neither file nor folder; a
`latest` that is not text, or a folder, gave a decode error or "no latest file"."""

from __future__ import annotations

import errno
import os

import pytest

from zeroshard.checkpoint.commit import CommittedWithoutLatest, commit_tag, validate_tag
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.load import resolve_tag_dir
from zeroshard.checkpoint.space import describe_write_error


@pytest.mark.parametrize("tag", ["latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py"])
def test_the_folders_own_names_are_refused_as_tags(tag, tmp_path) -> None:
    with pytest.raises(CheckpointError, match=f"checkpoint tag {tag!r} is the name of the save folder's"):
        validate_tag(tag, str(tmp_path))


def test_a_tag_where_a_file_is_is_refused(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="notes.txt exists and is not a checkpoint folder"):
        validate_tag("notes.txt", str(tmp_path))
    (tmp_path / "step1").mkdir()
    assert validate_tag("step1", str(tmp_path)) == "step1"  # a re-save of a tag


def test_a_commit_whose_latest_cannot_be_written_says_it_was_committed(tmp_path) -> None:
    (tmp_path / "latest").mkdir()  # what a pointer cannot replace
    staged = tmp_path / ".tmp.t.abc"
    staged.mkdir()
    with pytest.raises(CommittedWithoutLatest, match="t was committed, but .*latest could not be written") as failed:
        commit_tag(str(tmp_path), str(staged), "t", "abc", "{}", True)
    assert "load it with tag='t'" in str(failed.value)
    assert (tmp_path / "t" / "metadata.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "t"]  # no temporary pointer left beside it


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (errno.EDQUOT, "the disk quota is exceeded"),
        (errno.EFBIG, "a file grew past the largest this process may write"),
        (errno.EROFS, "the filesystem is read-only"),
        (errno.EIO, "the device reported an I/O error"),
    ],
)
def test_a_failed_write_names_the_file_and_the_folder(code, said, tmp_path) -> None:
    target = str(tmp_path / ".tmp.t.abc" / "optim" / "rank00000.safetensors")
    line = describe_write_error(OSError(code, os.strerror(code), target), str(tmp_path / ".tmp.t.abc"), 3 * 2**20)
    assert line.startswith(f"writing {target} failed: {said}") and f"3.0 MiB into {tmp_path}" in line, line


def test_a_latest_that_is_not_a_tag_is_named(tmp_path) -> None:
    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CheckpointError, match="latest: not a tag name .* pass tag="):
        resolve_tag_dir(str(tmp_path), None)
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").mkdir()
    with pytest.raises(CheckpointError, match="latest: a folder where the pointer file to the last tag belongs"):
        resolve_tag_dir(str(tmp_path), None)


def test_a_recovery_script_that_cannot_be_written_does_not_fail_the_save(tmp_path) -> None:
    """`zero_to_fp32.py` beside the checkpoint is a convenience: `latest` is written and the save stands (it said
    "latest could not be written" before, while `latest` named the tag)."""
    (tmp_path / "zero_to_fp32.py").mkdir()
    staged = tmp_path / ".tmp.t.abc"
    staged.mkdir()
    assert commit_tag(str(tmp_path), str(staged), "t", "abc", "{}", True) == str(tmp_path / "t")
    assert (tmp_path / "latest").read_text() == "t"
    assert (tmp_path / "zero_to_torch.py").is_file()  # the other script is written all the same


def test_a_filesystem_with_no_free_bytes_is_named_as_such() -> None:
    """A save to /sys or /proc said "0.0 MiB are free ... Free 0.0 MiB or save elsewhere"."""
    from zeroshard.checkpoint.space import check_space

    with pytest.raises(CheckpointError, match=r"the filesystem of /sys/ck \(host h\) has no free bytes at all"):
        check_space([{"bytes": 10, "fs": "h:7", "free": 0}, {"bytes": 10, "fs": "h:7", "free": 0}], "/sys/ck")
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[0, 1\] write about .* and 0.0 MiB are free"):
        check_space([{"bytes": 10, "fs": "h:7", "free": 15}, {"bytes": 10, "fs": "h:7", "free": 15}], "/data/ck")
    check_space([{"bytes": 10, "fs": "h:7", "free": 20}, {"bytes": 10, "fs": "h:7", "free": 20}], "/data/ck")
