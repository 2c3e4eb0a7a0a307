"""One report per failed job: the rank that failed first prints its error, the others one line pointing at it.

[Note: one failure report]
When a rank fails, the others usually fail too: with the same error (a refused checkpoint every rank reads),
or with a backend error because the first one left ("Connection closed by peer", a collective deadline).
Printed by every rank, that is a screen of duplicates and tracebacks hiding the one line that matters. So a
failing rank claims `zeroshard/failure/first` on the job's store (a compare-and-set, one round trip, only on
the way out); the rank that gets it reports as usual, every other rank writes `stopped, see rank N's error`
and exits with its own code. Where there is no store to ask (the group was never made, or its store is
gone), every rank reports as before: a duplicate is better than a lost error. `--debug` shows every rank's.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

FIRST_FAILURE_KEY = "zeroshard/failure/first"

# backend messages that mean another rank went away, not that this rank went wrong
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "communicator was aborted")


def job_rank() -> int | None:
    """This process's rank when it is one of several (under torchrun or `zeroshard launch`), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None


def first_failed_rank(rank: int) -> int | None:
    """The rank whose failure the job reports: this one if it is the first to ask; None when it cannot tell."""
    try:
        store = _job_store()
        if store is None:
            return None
        return int(store.compare_set(FIRST_FAILURE_KEY, "", str(rank)))
    except Exception:  # noqa: BLE001 - no answer: this rank reports its own error
        return None


def lost_a_peer(error: BaseException) -> str | None:
    """What a backend error says when it means another rank left (this rank has nothing of its own to
    report), else None."""
    text = str(error).lower()
    return next((s for s in _PEER_LOST if s in text), None) if isinstance(error, RuntimeError) else None


def _job_store() -> dist.Store | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or "MASTER_ADDR" not in os.environ:
        return None  # before the group exists, only torchrun's agent hosts a store this rank may join
    from zeroshard.launcher.rendezvous import attempt_store, env_store

    return attempt_store(env_store(datetime.timedelta(seconds=10))[0])
