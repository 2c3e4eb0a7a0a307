"""Calls that gather on the caller's behalf agree first, through the rendezvous store.

[Note: gathering calls agree first]
The calls that gather on the caller's behalf are collectives made from the caller's own code: at stage 3
`state_dict()`, `GatheredParameters` (its gather, and a modifier's broadcast), generation's whole-model gather, the
consolidated 16-bit state dict (`save_16bit_model`, accelerate's `get_state_dict`) and `safe_get_full_*` /
`safe_set_full_*`; at stages 1-2 the consolidated state dict and `safe_get_full_*`, which all-gather master, gradient
or optimizer-state shards (`safe_get_full_optimizer_state` first asks every rank whether the state exists, an
all-reduce, at stage 0 too).
There a rank-dependent branch sends ranks into different collectives: `if rank == 0: torch.save(model.state_dict())`,
or rank 0's `safe_get_full_grad(p)` beside the others' `safe_get_full_fp32_param(p)`. gloo's
per-collective fingerprints name that at the first collective; NCCL fingerprints nothing (a per-collective check would
sync the host with the GPU), so there all-gathers of equal sizes may pair up across the two calls and carry the wrong
unit's values without an error, or wait out the collective deadline (gloo with its fingerprints off aborted:
"Connection reset by peer"). So before such a call communicates, each rank posts on the process group's key-value
store (host-side on every backend) a digest of the collectives the call is about to issue, with the call's name; rank 0
reads the posts of that call number and posts a verdict, which the others read. Different collectives: a
`CollectiveMismatchError` on every rank, naming each rank's call. A rank that posts nothing within the timeout (it
skipped the call): a `CollectiveTimeoutError` naming it, after which this engine's gathering calls refuse to run (the
ranks' call numbers no longer line up). One call may give way instead: stage 3's `state_dict()`, whose DeepSpeed
counterpart communicates nothing, stands down to placeholders when every other rank is in the same
`GatheredParameters`-like block, and those post again for the next call of the ranks that stood down ([Note: a
state_dict() made alone]
in zero/stage3/gathering.py: DeepSpeed-Chat's rank-0 `save_hf_format` beside every rank's ZeRO-3 save).
Ranks whose calls issue the same collectives agree, whatever the calls are
(`state_dict()` on one rank and `GatheredParameters` over every parameter on another gather the same units); what a
read gathers is part of its collectives (one parameter's gradient and its master are gathers of the same sizes), and so
are the parameters' names and the engine's number (strategies are numbered in the order the ranks built them: two
parts of a torch_autocast split, or an actor and its reference model, hold parameters at the same bucket or unit
numbers, the latter under the same names). The cost
is four or five store round trips per call that communicates (units to gather, a modifier's broadcast; about 0.5 ms on
2 ranks here, store traffic growing with the ranks); calls that find everything gathered communicate nothing and post
nothing, and the training step's own gathers (hooks) are checked by the per-step digest instead ([Note: divergence
check] in divergence.py). The fsdp2 backend agrees the same way before FSDP's unshard of a unit it does not hold
gathered, a modifier's broadcast, `safe_get_full_*` and its full state dicts. Stage 3 on the CPU waits its divergence
timeout; every other strategy the store's. `GatheredParameters` before `initialize` (pending.py) agrees on its
broadcasts from rank 0 at entry and its modifier's at the end (the parameters by name in their model), through the
store's timeout too; `load_module_state_dict` agrees before the all-reduce of its outcome; the MoE split's full state
dict before its expert-parallel all-gathers.
"""

from __future__ import annotations

import datetime
import json
import os
import zlib
from typing import Any

import torch.distributed as dist

from zeroshard.comm.collectives import Collectives
from zeroshard.errors import SAME_MODULES, CollectiveMismatchError, CollectiveTimeoutError
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

_ROOT = "zeroshard/agree"
_SHOWN = 160  # characters of a call's collectives shown in a mismatch
_POSTED = 4096  # characters of them posted (the digest covers them all)
_STAND_DOWN = "stand down: "  # a verdict: these ranks' optional calls give way ([Note: a state_dict() made alone])


class CallAgreement:
    """The agreement of [Note: gathering calls agree first] for one engine's process group."""

    def __init__(self, comm: Collectives, timeout_s: float | None, numbered: bool = False):
        """`timeout_s` None: the store's own timeout (the process group's deadline, `zeroshard.collective_timeout_s`,
        when `initialize` created the group and its store). `numbered`: this agreement is one strategy's, numbered in
        the order the group's ranks built them (every rank builds the same engines in the same order), and its
        digests carry the number: two engines, or two parts of one, hold parameters at the same bucket or unit
        numbers and under the same names (an actor and its reference model)."""
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.timeout_s = timeout_s
        ranks = dist.get_process_group_ranks(comm.group) if comm.group is not None else []
        group = f"g{zlib.crc32(','.join(map(str, ranks)).encode()):08x}" if ranks else "world"
        # a restarted attempt may find the store of the one before (torchrun's agent store): its own numbers
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._space = f"{_ROOT}/{group}/{attempt}"
        self._store: dist.Store | None = None
        self._broken: str | None = None  # after a timeout the ranks' call numbers no longer line up
        self.instance = 0
        self._unavailable: str | None = None  # why there is no store to agree through (then calls go unchecked)
        self.stood_down_for = ""  # the other ranks' call an optional call last gave way to
        if numbered and self.world_size > 1:
            try:
                self.instance = int(self._default_store().add(f"{self._space}/instances/{self.rank}", 1))
            except (RuntimeError, ValueError, AttributeError, NotImplementedError) as err:
                self._no_store(err)

    def agree(self, call: str, collectives: str, awaited: str = "a gathering call", role: str = "call") -> bool:
        """Every rank of the group is making a call that issues `collectives` (a description every rank computes
        alike); `call` names it in the error, `awaited` says what an absent rank did not do. Returns once all
        posted the same collectives; raises otherwise. Rank 0 reads the posts and posts the verdict, which the
        others read: store traffic grows with the ranks, not with their square. `role`: "block" for a
        `GatheredParameters`-like block, "optional" for a call that may stand down to one ([Note: a state_dict() made
        alone]): False is returned when it did (`stood_down_for` names the others' call), True when the ranks agreed."""
        if self.world_size == 1 or self._unavailable is not None:
            return True
        if self._broken is not None:
            raise CollectiveMismatchError(
                f"{call} cannot be checked against the other ranks: an earlier gathering call timed out "
                f"({self._broken}), after which the ranks' calls no longer line up; the run cannot go on"
            )
        try:
            store = self._default_store()
        except (RuntimeError, ValueError, AttributeError, NotImplementedError) as err:
            self._no_store(err)
            return True
        timeout = self.timeout_s if self.timeout_s is not None else store.timeout.total_seconds()  # type: ignore[attr-defined]
        if self.instance:
            collectives = f"engine {self.instance}: {collectives}"
        digest = zlib.crc32(collectives.encode())
        while True:
            number = store.add(f"{self._space}/calls/{self.rank}", 1)
            store.set(self._post(number, self.rank), json.dumps([call, digest, collectives[:_POSTED], role]))
            try:
                verdict = self._verdict(store, number, datetime.timedelta(seconds=timeout))
            except RuntimeError as err:  # a store timeout (DistStoreError is one)
                self._broken = f"{call}, call {number} of rank {self.rank}"
                if isinstance(err, dist.DistNetworkError):  # not a timeout: the store's host went away
                    raise CollectiveTimeoutError(
                        f"rank {self.rank} made {call} and the rendezvous store stopped answering ({err}): its host "
                        "(rank 0, or the launcher's agent) has exited, on an error of its own or done before this "
                        "rank: see its log"
                    ) from err
                raise CollectiveTimeoutError(self._absent(store, number, call, timeout, awaited)) from err
            if number > 1:  # rank 0 read this rank's previous post before it posted this verdict
                store.delete_key(self._post(number - 1, self.rank))
            if not verdict:
                return True
            if verdict.startswith(_STAND_DOWN):  # [Note: a state_dict() made alone]
                standing, self.stood_down_for = json.loads(verdict[len(_STAND_DOWN) :])
                if self.rank in standing:
                    store.set(f"{self._space}/stood/{self.rank}", json.dumps([number, call]))
                    return False
                continue  # the ranks that stood down make their next call: this one is posted again for it
            raise CollectiveMismatchError(
                f"ranks made different gathering calls ({verdict}); each is a collective that every rank must make "
                f"in the same order. {SAME_MODULES}"
            )

    def before_block(
        self,
        call: str,
        gathers: list[Any],
        modifier_rank: int | None,
        units: int,
        optional: bool = False,
        whole: bool = False,
    ) -> bool:
        """Before a `GatheredParameters`-like block over `units` units communicates: `gathers` names what it gathers
        (nothing when all are gathered already), a modifier's broadcast at the block's end is part of what is agreed.
        A block that sends nothing posts nothing. False: an `optional` call stood down (`agree`). `whole`: the block
        holds every parameter of the model (generation's way), which a lone `state_dict()` may pair with."""
        broadcast = f"; broadcast from rank {modifier_rank} at the end" if modifier_rank is not None and units else ""
        if not (gathers or broadcast):
            return True
        shown = call if modifier_rank is None else f"{call}, modifier_rank={modifier_rank}"
        role = "optional" if optional else "whole" if whole else "block"
        return self.agree(shown, f"all-gather of units {gathers}{broadcast}", role=role)

    def before_broadcast(self, modifier_rank: int, units: list[Any]) -> None:
        """At a block's end, before its modifier's broadcast: a rank whose block raised does not broadcast."""
        self.agree(
            f"the end of GatheredParameters(modifier_rank={modifier_rank})",
            f"broadcast from rank {modifier_rank} of units {units}",
            awaited="the end of its GatheredParameters block (one that raised on a rank does not broadcast)",
        )

    def _verdict(self, store: dist.Store, number: int, timeout: datetime.timedelta) -> str:
        """Empty when every rank posted the same collectives; else each rank's call, described."""
        key = f"{self._space}/{number}/verdict"
        if self.rank != 0:
            store.wait([key], timeout)
            return store.get(key).decode()
        posts = [self._post(number, r) for r in range(self.world_size)]
        store.wait(posts, timeout)
        seen = [json.loads(value) for value in _get_all(store, posts)]
        others = [(name, digest, role) for name, digest, _, role in seen if role != "optional"]
        theirs = others[0][1] if others else None
        # An optional call (a lone state_dict()) pairs with blocks over the whole model that gather what it gathers;
        # beside blocks over some parameters it stands down even where it would gather the same units (a model of one
        # unit): paired, the ranks would make different numbers of calls from there on
        partial = any(role == "block" for _, _, role in others)
        standing = [r for r, (_, d, _, role) in enumerate(seen) if role == "optional" and (d != theirs or partial)]
        if others and standing and all(role in ("block", "whole") and d == theirs for _, d, role in others):
            verdict = _STAND_DOWN + json.dumps([standing, others[0][0]])  # they gave way to GatheredParameters blocks
        elif len({digest for _, digest, _, _ in seen}) == 1:
            verdict = ""
        else:
            shown = _where_they_differ([what for _, _, what, _ in seen])
            verdict = "; ".join(f"rank {r}: {name} ({shown[r]})" for r, (name, *_) in enumerate(seen))
        store.set(key, verdict)
        if number > 1:  # every rank read the previous verdict before it posted for this call
            store.delete_key(f"{self._space}/{number - 1}/verdict")
        return verdict

    def _absent(self, store: dist.Store, number: int, call: str, timeout: float, awaited: str) -> str:
        missing = [r for r in range(self.world_size) if not store.check([self._post(number, r)])]
        stood = [(r, json.loads(store.get(k))) for r in missing if store.check([k := f"{self._space}/stood/{r}"])]
        if stood and stood[-1][1][0] == number - 1:  # it gave way at the previous call and made none since
            r, (at, what) = stood[-1]
            return (
                f"rank {self.rank} made {call}, which gathers, and rank {r} stood its {what} down to DeepSpeed's "
                f"placeholders at call {at} ([Note: a state_dict() made alone]) but made no gathering call after it "
                f"within {timeout:.0f}s: make the same calls on every rank"
            )
        if not missing:  # every rank posted; rank 0, which rules, did not
            return (
                f"rank {self.rank} made {call}, which gathers, and every rank posted a call, but rank 0 "
                f"gave no verdict within {timeout:.0f}s: it is stalled, or an earlier gathering call timed out there"
            )
        return (
            f"rank {self.rank} made {call}, which gathers and so is a collective, and rank(s) {missing} did "
            f"not make {awaited} within {timeout:.0f}s: every rank must make it (a call under `if rank == 0:` cannot "
            "gather the other ranks' shards; gather on every rank, then save on one, as engine.save_16bit_model does)"
        )

    def _no_store(self, err: BaseException) -> None:
        self._unavailable = f"{type(err).__name__}: {err}"
        logger.warning(
            "the process group's key-value store cannot be used (%s): gathering calls will not be checked against "
            "the other ranks first ([Note: gathering calls agree first])",
            self._unavailable,
        )

    def _post(self, number: int, rank: int) -> str:
        return f"{self._space}/{number}/{rank}"

    def _default_store(self) -> dist.Store:
        if self._store is None:
            from torch.distributed import distributed_c10d

            self._store = distributed_c10d._get_default_store()
        return self._store


def _where_they_differ(texts: list[str]) -> list[str]:
    """Each rank's description, cut to `_SHOWN` characters around where the descriptions first differ."""
    if len(set(texts)) == 1:  # the digests cover more than is posted
        return [f"{t[:_SHOWN]}... (they differ beyond the first {_POSTED} characters)" for t in texts]
    common = len(os.path.commonprefix(texts))
    start = max(0, common - _SHOWN // 3) if any(len(t) > _SHOWN for t in texts) else 0
    cut = [t[start : start + _SHOWN] for t in texts]
    return [
        ("..." if start else "") + c + ("..." if start + _SHOWN < len(t) else "")
        for c, t in zip(cut, texts, strict=True)
    ]


def _get_all(store: dist.Store, keys: list[str]) -> list[bytes]:
    """One round trip where the store has `multi_get` (TCPStore and its prefixes); else one per key."""
    try:
        return list(store.multi_get(keys))
    except (AttributeError, NotImplementedError, RuntimeError):
        return [store.get(key) for key in keys]
