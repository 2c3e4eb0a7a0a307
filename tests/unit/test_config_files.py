"""A ds_config from a source other than a dict: a JSON (or hjson) file, or base64-encoded JSON; each failure one line
naming the file (or the string) and what is wrong."""

from __future__ import annotations

import base64
import pathlib

import pytest

from helpers.config_checks import error_of, warnings_of
from zeroshard.config import parse_config


def test_missing_file_names_the_file(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.json"
    assert error_of(missing) == f"ds_config file {missing} does not exist"


def test_bad_json_names_file_line_and_column(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true]\n}\n')  # neither JSON nor hjson
    message = error_of(path)
    assert message.startswith(f"ds_config file {path} is not valid JSON: ")
    assert "at line 3 column" in message and "nor hjson" in message


def test_an_hjson_file_reads_as_deepspeed_reads_it(tmp_path: pathlib.Path) -> None:
    """DeepSpeed reads config files with hjson: comments, unquoted keys and trailing commas."""
    path = tmp_path / "ds_config.json"
    path.write_text('{\n  # a comment\n  train_batch_size: 8,\n  "fp16": {"enabled": true,},\n}\n')
    cfg = parse_config(str(path))
    assert cfg.train_batch_size == 8 and cfg.fp16.enabled


def test_json_that_is_not_an_object(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert error_of(path) == f"ds_config file {path} holds a JSON list, not an object"


def test_base64_json_reads_as_deepspeed_reads_it(tmp_path: pathlib.Path) -> None:
    """DeepSpeed's autotuner hands a trial's config to the script as `--deepspeed_config <urlsafe base64>`; its
    DeepSpeedConfig decodes a string that is no existing path, and so does parse_config."""
    text = '{"train_batch_size": 8, "zero_optimization": {"stage": 2}}'
    encoded = base64.urlsafe_b64encode(text.encode()).decode()
    cfg = parse_config(encoded)
    assert (cfg.train_batch_size, cfg.zero_optimization.stage) == (8, 2)
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76)) + "\n"  # as `base64` prints it
    assert parse_config(wrapped).train_batch_size == 8
    assert parse_config(base64.urlsafe_b64encode(b'{"fp16": {"enabled": true,},}').decode()).fp16.enabled  # hjson
    shown = lambda raw: repr(raw[:40] + "...")  # noqa: E731
    wrong = base64.urlsafe_b64encode(b'{"zero_optimization": {"stage": 2, "stage": 3}}').decode()
    assert error_of(wrong) == (
        f'ds_config {shown(wrong)} (no existing file; read as base64): key "stage" appears twice, with 2 and 3; '
        "keep one"
    )
    typo = base64.urlsafe_b64encode(b'{"train_batch_sise": 8}').decode()
    assert error_of(typo) == "train_batch_sise: unknown key; did you mean train_batch_size?"
    listed = base64.urlsafe_b64encode(b"[1, 2]").decode()
    assert (
        error_of(listed) == f"ds_config '{listed}' (no existing file; read as base64) holds a JSON list, not an object"
    )
    for bad, reason in ((encoded.rstrip("="), "incorrect padding"), ("6Sfp", "not UTF-8 text")):
        assert error_of(bad) == (
            f"ds_config {bad if len(bad) <= 40 else bad[:40] + '...'!r} is no existing file, nor "
            f"urlsafe-base64-encoded JSON ({reason}); pass the path of a JSON file, a dict, or the config's JSON "
            "encoded with base64.urlsafe_b64encode"
        )
    # a file of that name is a file, and a path object is always one (DeepSpeed decodes strings only)
    (tmp_path / "ZZZZ").write_text('{"train_batch_size": 4}')
    assert parse_config(str(tmp_path / "ZZZZ")).train_batch_size == 4
    assert error_of(pathlib.Path(encoded)) == f"ds_config file {encoded} does not exist"
    assert error_of("ds_config.json") == "ds_config file ds_config.json does not exist"


def test_directory_is_not_a_config(tmp_path: pathlib.Path) -> None:
    assert error_of(tmp_path).startswith(f"ds_config file {tmp_path} cannot be read")


def test_duplicate_json_keys(tmp_path: pathlib.Path, log: pytest.LogCaptureFixture) -> None:
    same = tmp_path / "same.json"
    same.write_text('{"gradient_accumulation_steps": 4, "gradient_accumulation_steps": 4}')
    assert parse_config(same).gradient_accumulation_steps == 4
    assert warnings_of(log) == [
        f'zeroshard: key "gradient_accumulation_steps" appears twice in ds_config file {same} with the same value'
    ]
    different = tmp_path / "different.json"
    different.write_text('{"zero_optimization": {"stage": 1, "stage": 2}}')
    assert error_of(different) == f'ds_config file {different}: key "stage" appears twice, with 1 and 2; keep one'
