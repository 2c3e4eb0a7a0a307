"""Calls that gather at stage 3 on the caller's behalf agree first, through the rendezvous store.

[Note: gathering calls agree first]
`state_dict()`, `GatheredParameters` and generation's whole-model gather are collectives at stage 3, made from the
caller's own code, where a rank-dependent branch sends ranks into different collectives: `if rank == 0:
torch.save(model.state_dict(), ...)`, or DeepSpeed-Chat's rank-0 `save_hf_format` beside every rank's per-parameter
`GatheredParameters` save. gloo's per-collective fingerprints name that at the first collective; NCCL fingerprints
nothing (a per-collective check would sync the host with the GPU), so there all-gathers of equal sizes may pair up
across the two calls and carry the wrong unit's values without an error, or wait out the collective deadline (gloo with
its fingerprints off aborted: "Connection reset by peer"). So before such a call communicates, each rank posts on the
process group's key-value store (host-side on every backend) which collectives the call is about to issue and what the
call is, and reads the other ranks' posts for the same call number. Different collectives: a `CollectiveMismatchError`
on every rank, naming each rank's call. A rank that posts nothing within the timeout (it skipped the call): a
`CollectiveTimeoutError` naming it. Ranks whose calls issue the same collectives agree, whatever the calls are
(`state_dict()` on one rank and `GatheredParameters` over every parameter on another gather the same units). The cost is
five store round trips per call that communicates (units to gather, a modifier's broadcast); calls that find everything
gathered communicate nothing and post nothing, and the training step's own gathers (hooks) are checked by the per-step
digest instead ([Note: divergence check] in divergence.py).
"""

from __future__ import annotations

import datetime
import json

import torch.distributed as dist

from zeroshard.comm.collectives import Collectives
from zeroshard.errors import SAME_MODULES, CollectiveMismatchError, CollectiveTimeoutError

_ROOT = "zeroshard/agree"


class CallAgreement:
    """The agreement of [Note: gathering calls agree first] for one engine's process group."""

    def __init__(self, comm: Collectives, timeout_s: float | None):
        """`timeout_s` None: the store's own, which is the process group's deadline (`zeroshard.collective_timeout_s`
        when `initialize` creates the group), as long as a collective would wait."""
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.timeout_s = timeout_s
        ranks = dist.get_process_group_ranks(comm.group) if comm.group is not None else []
        self._space = f"{_ROOT}/{'-'.join(map(str, ranks)) or 'world'}"
        self._store: dist.Store | None = None

    def agree(self, call: str, collectives: str) -> None:
        """Every rank of the group is making a call that issues `collectives` (a description every rank computes
        alike); `call` names it in the error. Returns once all posted the same; raises otherwise."""
        if self.world_size == 1:
            return
        store = self._default_store()
        timeout = self.timeout_s if self.timeout_s is not None else store.timeout.total_seconds()  # type: ignore[attr-defined]
        number = store.add(f"{self._space}/calls/{self.rank}", 1)
        store.set(self._key(number, self.rank), json.dumps([call, collectives]))
        keys = [self._key(number, r) for r in range(self.world_size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
        except RuntimeError as err:  # a store timeout (DistStoreError is one)
            raise CollectiveTimeoutError(self._absent(store, keys, call, timeout)) from err
        posts = [json.loads(value) for value in _get_all(store, keys)]
        if number > 1:  # every rank read call number - 1 before it posted this one
            store.delete_key(self._key(number - 1, self.rank))
        if any(collectives != theirs for _, theirs in posts):
            described = "; ".join(f"rank {r}: {name} ({what})" for r, (name, what) in enumerate(posts))
            raise CollectiveMismatchError(
                f"ranks made different gathering calls at stage 3 ({described}); each is a collective that every "
                f"rank must make in the same order. {SAME_MODULES}"
            )

    def _absent(self, store: dist.Store, keys: list[str], call: str, timeout: float) -> str:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        return (
            f"rank {self.rank} made {call}, which gathers at stage 3 and so is a collective, and rank(s) {missing} did "
            f"not make a gathering call within {timeout:.0f}s: every rank must make it (a call under "
            "`if rank == 0:` cannot gather the other ranks' shards; gather on every rank, then save on one, as "
            "engine.save_16bit_model does)"
        )

    def _key(self, number: int, rank: int) -> str:
        return f"{self._space}/{number}/{rank}"

    def _default_store(self) -> dist.Store:
        if self._store is None:
            from torch.distributed import distributed_c10d

            self._store = distributed_c10d._get_default_store()
        return self._store


def _get_all(store: dist.Store, keys: list[str]) -> list[bytes]:
    """One round trip where the store has `multi_get` (TCPStore and its prefixes); else one per key."""
    try:
        return list(store.multi_get(keys))
    except (AttributeError, NotImplementedError, RuntimeError):
        return [store.get(key) for key in keys]
