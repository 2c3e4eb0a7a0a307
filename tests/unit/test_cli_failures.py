"""[Note: one failure report]: with several ranks, the rank that fails first reports, the others point at it."""

from __future__ import annotations

import argparse

import pytest
import torch.distributed as dist

from zeroshard.checkpoint import CheckpointError
from zeroshard.cli import failures
from zeroshard.cli.main import run_guarded

GLOO_PEER_LOST = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:22413"


def _fail_as(monkeypatch, capsys, store, rank: int, error: Exception) -> tuple[int, list[str]]:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(failures, "_job_store", lambda: store)

    def run(args: argparse.Namespace) -> int:
        raise error

    code = run_guarded(run, argparse.Namespace(), "zeroshard train")
    return code, capsys.readouterr().err.splitlines()


def test_the_first_failure_is_reported_and_a_consequence_points_at_it(monkeypatch, capsys):
    store = dist.HashStore()
    code, lines = _fail_as(monkeypatch, capsys, store, 1, CheckpointError("disk full on rank 1"))
    assert (code, lines) == (1, ["zeroshard train [rank 1]: error: disk full on rank 1"])
    code, lines = _fail_as(monkeypatch, capsys, store, 0, RuntimeError(GLOO_PEER_LOST))
    assert (code, lines) == (1, ["zeroshard train [rank 0]: stopped, see rank 1's error"])


def test_a_rank_that_only_lost_its_peer_says_so_in_one_line(monkeypatch, capsys):
    code, lines = _fail_as(monkeypatch, capsys, dist.HashStore(), 0, RuntimeError(GLOO_PEER_LOST))
    assert code == 1 and len(lines) == 1 and "another rank left the job" in lines[0], lines


def test_without_a_store_every_rank_reports_and_bugs_keep_their_traceback(monkeypatch, capsys):
    code, lines = _fail_as(monkeypatch, capsys, None, 1, CheckpointError("refused"))
    assert (code, lines) == (1, ["zeroshard train [rank 1]: error: refused"])
    with pytest.raises(KeyError):
        _fail_as(monkeypatch, capsys, dist.HashStore(), 0, KeyError("a bug"))


def test_the_launcher_line_names_a_signal():
    from zeroshard.launcher.torchrun import _how

    assert (_how(5), _how(-9)) == ("exit code 5", "killed by SIGKILL")
