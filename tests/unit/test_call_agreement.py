"""[Note: gathering calls agree first] (comm/agreement.py) without a process group: ranks are threads sharing one
in-memory store (torch's HashStore), so the protocol's outcomes and its store traffic are checked directly."""

from __future__ import annotations

import datetime
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from helpers.config_checks import warnings_of
from zeroshard.comm.agreement import CallAgreement
from zeroshard.errors import CollectiveMismatchError, CollectiveTimeoutError


def _agreements(world_size: int, timeout_s: float | None, store: dist.Store) -> list[CallAgreement]:
    out = []
    for rank in range(world_size):
        agreement = CallAgreement(SimpleNamespace(rank=rank, world_size=world_size, group=None), timeout_s)  # type: ignore[arg-type]
        agreement._store = store
        out.append(agreement)
    return out


def _on_ranks(calls: list[Any]) -> list[BaseException | None]:
    """Run one call per rank at once; what each raised (None: returned)."""
    outcomes: list[BaseException | None] = [None] * len(calls)

    def run(rank: int) -> None:
        try:
            calls[rank]()
        except BaseException as e:  # noqa: BLE001 - the outcome is the test's subject
            outcomes[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


def test_same_collectives_agree_whatever_the_calls_and_old_posts_go() -> None:
    store = dist.HashStore()
    ranks = _agreements(3, 10, store)
    for _ in range(5):
        outcomes = _on_ranks([lambda a=a: a.agree(f"call {a.rank}", "all-gather of units [1, 2]") for a in ranks])
        assert outcomes == [None, None, None]
    space = ranks[0]._space
    left = [k for n in range(1, 6) for k in (*(f"{space}/{n}/{r}" for r in range(3)), f"{space}/{n}/verdict")]
    assert [k for k in left if store.check([k])] == [
        f"{space}/5/0",
        f"{space}/5/1",
        f"{space}/5/2",
        f"{space}/5/verdict",
    ]


def test_different_collectives_are_named_on_every_rank() -> None:
    ranks = _agreements(2, 10, dist.HashStore())
    outcomes = _on_ranks(
        [
            lambda: ranks[0].agree("state_dict()", "all-gather of units [0, 1, 2]"),
            lambda: ranks[1].agree("GatheredParameters over 1 parameter(s)", "all-gather of units [1]"),
        ]
    )
    for error in outcomes:
        assert isinstance(error, CollectiveMismatchError)
        assert "rank 0: state_dict() (all-gather of units [0, 1, 2])" in str(error)
        assert "rank 1: GatheredParameters over 1 parameter(s) (all-gather of units [1])" in str(error)
    # a mismatch leaves the numbers in step: the next calls agree
    assert _on_ranks([lambda a=a: a.agree("x", "same") for a in ranks]) == [None, None]


def test_an_absent_rank_is_named_and_the_numbers_are_not_trusted_after() -> None:
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=1))  # timeout_s None: the store's own
    ranks = _agreements(2, None, store)
    absent = r"rank 0 made state_dict\(\).*rank\(s\) \[1\] did not make a "
    with pytest.raises(CollectiveTimeoutError, match=absent):
        ranks[0].agree("state_dict()", "all-gather of units [0]")
    # rank 1 arrives late, with a correct program's next call: the other rank refuses rather than pair it wrongly
    outcomes = _on_ranks([lambda: ranks[0].agree("state_dict()", "u"), lambda: ranks[1].agree("state_dict()", "u")])
    assert isinstance(outcomes[0], CollectiveMismatchError) and "timed out" in str(outcomes[0])
    assert isinstance(outcomes[1], CollectiveTimeoutError) and "rank 0 gave no verdict" in str(outcomes[1])


def test_rank_zero_absent_is_named_by_the_others() -> None:
    ranks = _agreements(3, 1, dist.HashStore())
    outcomes = _on_ranks([lambda: None, lambda: ranks[1].agree("c", "u"), lambda: ranks[2].agree("c", "u")])
    for error in outcomes[1:]:
        assert isinstance(error, CollectiveTimeoutError) and "rank(s) [0] did not make" in str(error)


def test_one_rank_needs_no_store() -> None:
    agreement = CallAgreement(SimpleNamespace(rank=0, world_size=1, group=None), 1)  # type: ignore[arg-type]
    agreement.agree("state_dict()", "all-gather of units [0]")
    assert agreement._store is None


class _HostGone:
    """A store whose host exited: every wait fails as a TCPStore client's does then."""

    def __init__(self, inner: dist.Store):
        self.inner = inner
        self.timeout = datetime.timedelta(seconds=5)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        raise dist.DistNetworkError("Connection reset by peer")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_store_whose_host_exited_is_named_as_such() -> None:
    agreement = _agreements(2, 5, dist.HashStore())[1]
    agreement._store = _HostGone(agreement._store)  # type: ignore[assignment]
    with pytest.raises(CollectiveTimeoutError, match="rendezvous store stopped answering .*has exited"):
        agreement.agree("state_dict()", "all-gather of units [0]")


def test_digests_carry_the_engine_and_the_message_shows_where_they_differ() -> None:
    store = dist.HashStore()
    first = _agreements(2, 10, store)
    for a in first:
        a.instance = 1
    units = f"all-gather of units {list(range(60))}"
    outcomes = _on_ranks([lambda: first[0].agree("a", units), lambda: first[1].agree("b", units.replace("[0,", "[1,"))])
    assert all(isinstance(o, CollectiveMismatchError) for o in outcomes), outcomes
    same_elsewhere = _agreements(2, 10, store)
    same_elsewhere[1].instance = 2  # another engine: the same units
    outcomes = _on_ranks([lambda: first[0].agree("a", units), lambda: same_elsewhere[1].agree("a", units)])
    message = str(outcomes[0])
    assert "(engine 1: all-gather of units [0, 1," in message and "(engine 2: all-gather of units [0, 1," in message


def test_long_descriptions_are_shown_around_their_first_difference() -> None:
    ranks = _agreements(2, 10, dist.HashStore())
    long = f"all-gather of units {list(range(100))}"
    other = long.replace("98, 99]", "98, 1000]")
    outcomes = _on_ranks([lambda: ranks[0].agree("a", long), lambda: ranks[1].agree("a", other)])
    message = str(outcomes[1])
    assert "rank 0: a (... 86, 87," in message and "97, 98, 99]); rank 1: a (... 86," in message, message
    assert "97, 98, 1000]))" in message, message


def test_without_a_usable_store_calls_go_unchecked_after_one_warning(monkeypatch: pytest.MonkeyPatch, log) -> None:
    def no_store(self: CallAgreement) -> dist.Store:
        raise RuntimeError("this backend has no key-value store")

    monkeypatch.setattr(CallAgreement, "_default_store", no_store)
    comm = SimpleNamespace(rank=1, world_size=2, group=None)
    agreement = CallAgreement(comm, 5, numbered=True)  # type: ignore[arg-type]
    assert any("cannot be used (RuntimeError: this backend has no key-value store)" in w for w in warnings_of(log))
    agreement.agree("state_dict()", "all-gather of units [0]")  # returns: nothing to agree through


def test_an_optional_call_that_differs_stands_down_and_the_others_meet_its_next_call() -> None:
    """[Note: a state_dict() made alone]: rank 0's optional call differs from ranks 1 and 2, which agree: rank 0 stands
    down (False) and makes its next call, which the others' posted-again call meets."""
    ranks = _agreements(3, 10, dist.HashStore())
    stood: list[bool] = []

    def rank0_same_units() -> None:
        stood.append(ranks[0].agree("state_dict()", "all-gather of units [0]", role="optional"))
        stood.append(ranks[0].agree("GatheredParameters", "all-gather of units [0]", role="block"))

    def rank0() -> None:
        stood.append(ranks[0].agree("state_dict()", "all-gather of units [0, 1, 2]", role="optional"))
        stood.append(ranks[0].agree("GatheredParameters", "all-gather of units [1]", role="block"))

    others = [lambda a=a: a.agree("GatheredParameters", "all-gather of units [1]", role="block") for a in ranks[1:]]
    assert _on_ranks([rank0, *others]) == [None, None, None]
    assert stood == [False, True] and ranks[0].stood_down_for == "GatheredParameters"
    # the same units as the others' blocks over some parameters (a model of one unit): it stands down all the same,
    # or the ranks would pair its gather with the others' first block and make different numbers of calls after
    stood.clear()
    others = [lambda a=a: a.agree("GatheredParameters", "all-gather of units [0]", role="block") for a in ranks[1:]]
    assert _on_ranks([rank0_same_units, *others]) == [None, None, None]
    assert stood == [False, True]
    # beside blocks over the whole model ("whole") that gather the same units it pairs with them
    others = [lambda a=a: a.agree("GatheredParameters", "all-gather of units [0]", role="whole") for a in ranks[1:]]
    stood.clear()
    alone = [lambda: stood.append(ranks[0].agree("state_dict()", "all-gather of units [0]", role="optional"))]
    assert _on_ranks([*alone, *others]) == [None, None, None]
    assert stood == [True]
    # optional calls that differ among themselves, with no other call to give way to: named
    outcomes = _on_ranks(
        [lambda a=a: a.agree("state_dict()", f"all-gather of units [{a.rank}]", role="optional") for a in ranks]
    )
    assert all(isinstance(o, CollectiveMismatchError) for o in outcomes), outcomes
    # an optional call gives way to blocks only: beside another kind of call it is a mismatch
    outcomes = _on_ranks(
        [lambda: ranks[0].agree("state_dict()", "all-gather of units [0, 1, 2]", role="optional")]
        + [lambda a=a: a.agree("safe_get_full_fp32_param", "all-gather of unit 1") for a in ranks[1:]]
    )
    assert all(isinstance(o, CollectiveMismatchError) for o in outcomes), outcomes
