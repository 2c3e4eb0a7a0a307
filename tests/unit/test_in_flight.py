"""[Note: nothing held by a collective at exit]: `InFlight` follows a collective's tensors by their owner count and
its works by completion; here a view stands in for the backend's reference (a view owns its base, as a work owns
its tensors) and a small object with `is_completed` for a work Python still holds."""

from __future__ import annotations

import threading
import time

import torch

from zeroshard.comm.in_flight import InFlight, quiesce


class _Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_a_dropped_work_is_waited_for_until_the_backend_lets_its_tensor_go():
    in_flight = InFlight()
    message = torch.zeros(8)
    in_flight.issue([message], lambda: None)  # a synchronous collective: Python kept no work
    assert in_flight.held() == 0
    holder = [message[:4]]  # the backend's reference, dropped by its worker a little later
    assert in_flight.held() == 1
    assert in_flight.drain(timeout_s=0.05) is False  # bounded: a peer that never comes is not waited for forever
    threading.Timer(0.2, holder.clear).start()
    start = time.monotonic()
    assert in_flight.drain(timeout_s=5.0) is True
    assert 0.15 < time.monotonic() - start < 4.0
    assert in_flight.held() == 0


def test_a_work_python_holds_is_waited_for_until_it_completes():
    in_flight = InFlight()
    message, work = torch.zeros(8), _Work()
    in_flight.issue([message], lambda: work)
    holder = message[:4]  # held by the work until Python drops the work, on the main thread: harmless
    assert in_flight.held() == 1
    threading.Timer(0.2, lambda: setattr(work, "done", True)).start()
    assert in_flight.drain(timeout_s=5.0) is True
    assert holder.numel() == 4


def test_a_dead_tensor_is_settled_and_a_shared_one_is_not_followed():
    in_flight = InFlight()
    scratch = torch.zeros(8)
    in_flight.issue([scratch], lambda: None)
    del scratch  # the collective's views died with their work
    shared = torch.zeros(8)
    view = shared[:2]  # owned elsewhere already: the work's drop can never leave the wrapper as the last owner
    in_flight.issue([shared], lambda: None)  # not followed: held below would count it
    assert in_flight.held() == 0
    assert in_flight.drain(timeout_s=0.05) is True
    assert view.numel() == 2


def _busy_without_the_gil(seconds: float) -> threading.Thread:
    """A thread that runs for about `seconds` inside torch (which releases the GIL), like a backend worker."""
    a = torch.randn(256, 256) / 16

    def run() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            torch.linalg.matrix_power(a, 1 << 10)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_quiesce_waits_for_a_running_thread_and_is_bounded():
    assert quiesce(timeout_s=1.0) is True  # nothing else runs: a few ms
    thread = _busy_without_the_gil(0.4)
    start = time.monotonic()
    assert quiesce(timeout_s=5.0) is True
    assert time.monotonic() - start > 0.3
    thread.join()
    thread = _busy_without_the_gil(1.0)
    start = time.monotonic()
    assert quiesce(timeout_s=0.2) is False  # a thread that never rests costs the bound, not a hang
    assert time.monotonic() - start < 0.8
    thread.join()


def test_an_in_flight_nothing_holds_is_freed_and_the_exit_hook_drains_the_live_ones():
    """A `Collectives` made per call (the sequence-parallel layers over a user's own group) made an InFlight each, and
    each stayed alive in its own atexit hook: ~1 KB and a 7 ms quiesce at exit per call, millions over a run."""
    import gc
    import weakref

    from zeroshard.comm import in_flight as module

    dropped = [weakref.ref(InFlight()) for _ in range(100)]
    gc.collect()
    assert all(ref() is None for ref in dropped)
    kept, message = InFlight(), torch.zeros(8)
    kept.issue([message], lambda: None)
    holder = [message[:4]]  # the backend's reference, dropped by its worker a little later
    assert kept in module._ALIVE and kept.held() == 1
    threading.Timer(0.2, holder.clear).start()
    start = time.monotonic()
    module._at_exit()  # what the interpreter runs at exit: the live one is drained
    assert kept.held() == 0 and time.monotonic() - start > 0.15
