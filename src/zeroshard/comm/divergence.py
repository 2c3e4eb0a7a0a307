"""Ranks that took different code paths: named in an error instead of a hang.

[Note: divergence check]
Stage 3 issues many collectives from hooks, where ranks that ran different modules would otherwise hang or
abort in the backend. Three layers catch it: on gloo a fingerprint exchange before each collective (`Collectives`
with `verify=True`); a wait that times out asks every rank, through the rendezvous store, what it is waiting on
(`DivergenceWatch.wait`); and once per step a digest of the modules each rank ran, and (when collectives are not
fingerprinted: NCCL, where a per-collective check would sync the host with the GPU) of the units it gathered, is
compared (`check_step`). The module digest catches what no collective shows: a block skipped on one rank whose
parameters are all persistent (gathered once, never again) changes no collective at all.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from zeroshard.comm.collectives import Collectives, Handle
from zeroshard.errors import SAME_MODULES, CollectiveMismatchError, CollectiveTimeoutError, ZeroshardError


class DivergenceWatch:
    """Waits on collectives with a timeout on CPU and keeps the log of gathers the per-step digest covers."""

    def __init__(self, comm: Collectives, device: torch.device, timeout_s: float, name_of: Callable[[int], str]):
        self.comm = comm
        self.device = device
        self.timeout_s = timeout_s
        self._name_of = name_of  # unit index -> name, for the message
        self.gather_log: list[int] = []
        self.run_log: list[int] = []  # unit modules (blocks) each forward ran, by index

    def wait(self, handle: Handle | None, what: str) -> None:
        """Wait for `handle`; on gloo, a wait longer than the timeout becomes a `CollectiveMismatchError`."""
        if handle is None:
            return
        if self.comm.world_size == 1 or self.device.type != "cpu":
            handle.wait()  # NCCL: a stream wait; a CPU timeout here would block the host on the GPU
            return
        try:
            handle.wait(datetime.timedelta(seconds=self.timeout_s))  # type: ignore[call-arg]
        except RuntimeError as err:
            if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                raise
            raise CollectiveMismatchError(self._diagnose(what)) from err

    def _diagnose(self, what: str) -> str:
        recent = [self._name_of(i) for i in self.gather_log[-3:]]
        group = self.comm.group if self.comm.group is not None else dist.group.WORLD
        # posted under global ranks: the group ranks of two data-parallel groups (tensor parallelism, hpZ) collide
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.comm.world_size))
        lines = ask_every_rank("diag", ranks, f"waiting on {what}; last gathered units {recent}")
        return (
            f"ranks diverged: rank {self.comm.global_rank(self.comm.rank)} waited {self.timeout_s:.0f}s on {what}, "
            "which not every rank issued. " + "; ".join(lines) + ". " + SAME_MODULES
        )

    def check_step(self) -> None:
        """Once per step: every rank ran the same unit modules, and gathered the same units, in the same order
        (the gathers only when collectives are not fingerprinted: then they are checked one by one)."""
        world_size = self.comm.world_size
        gathers = [] if self.comm.verify else self.gather_log
        logs = (self.run_log, gathers)
        self.run_log, self.gather_log = [], []
        if world_size == 1:
            return
        digest = zlib.crc32(bytes(str(logs), "ascii"))
        mine = torch.tensor([digest, len(logs[0]), len(logs[1])], dtype=torch.int64, device=self.device)
        everyone = torch.zeros(3 * world_size, dtype=torch.int64, device=self.device)
        self.comm.all_gather(everyone, mine, label="per-step divergence digest")
        rows = everyone.view(world_size, 3).tolist()
        if any(row != rows[0] for row in rows):
            raise CollectiveMismatchError(
                "ranks ran different modules in this step: "
                + "; ".join(
                    f"rank {r}: {runs} block forwards, {gathers} gathers (digest {d})"
                    for r, (d, runs, gathers) in enumerate(rows)
                )
                + ". "
                + SAME_MODULES
            )


def ask_every_rank(topic: str, ranks: list[int], mine: str, answer_s: float = 5.0) -> list[str]:
    """Post what this rank is doing under `topic` on the rendezvous store and read the posts of `ranks` (global
    ranks, this one among them): a rank that does not post within `answer_s` (stalled, or blocked where it cannot
    notice) is named as not answering."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"zeroshard/{topic}/{dist.get_rank()}", mine)
    keys = {other: f"zeroshard/{topic}/{other}" for other in ranks}
    with contextlib.suppress(RuntimeError):  # one wait for all (one per rank took answer_s per silent rank)
        store.wait(list(keys.values()), datetime.timedelta(seconds=answer_s))
    lines = []
    for other, key in keys.items():
        try:
            lines.append(f"rank {other}: {store.get(key).decode()}" if store.check([key]) else "")
        except RuntimeError:  # (the store went away)
            lines.append("")
        lines[-1] = lines[-1] or f"rank {other}: did not answer (stalled, or busy elsewhere)"
    return lines


def group_timeout_s(comm: Collectives, configured: float) -> float:
    """The deadline of `comm`'s process group: the script may have started it with a timeout of its own (read from
    the backend's options, a private field of torch's; `configured` where it cannot be read)."""
    try:
        group = comm.group if comm.group is not None else dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        return float(group._get_backend(device).options._timeout.total_seconds())
    except Exception:  # (another torch's layout, a backend without options)
        return configured


@contextmanager
def named_on_timeout(comm: Collectives, what: str, timeout_s: float) -> Iterator[None]:
    """A collective inside the block that passes the process group's deadline (`zeroshard.collective_timeout_s`)
    becomes a `CollectiveTimeoutError` naming what each rank is doing, instead of a backend message."""
    try:
        yield
    except RuntimeError as err:
        text = str(err).lower()  # gloo says "Timed out waiting ..." or "Application timeout caused pair closure"
        # every rank of the job is asked, not only `comm`'s: under tensor parallelism that is the data-parallel group
        # (of one rank where autotp_size is the world) while the collective that timed out was the model-parallel one
        world = dist.get_world_size() if dist.is_initialized() else 1
        if isinstance(err, ZeroshardError) or world == 1 or not ("timed out" in text or "timeout" in text):
            raise
        lines = ask_every_rank("deadline", list(range(world)), f"in {what}")
        raise CollectiveTimeoutError(
            f"a collective in {what} waited longer than {group_timeout_s(comm, timeout_s):.0f}s (the process group's "
            "timeout: zeroshard.collective_timeout_s where zeroshard starts the group): "
            + "; ".join(lines)
            + ". A rank that did not answer is stalled (stopped, swapping, deadlocked) or never reached this "
            "collective; the job stops here rather than hang."
        ) from err


_RAISES = itertools.count()  # this process's backwards that raised: ranks that raise together count alike


def raised_on_every_rank(comm: Collectives, call: str, timeout_s: float) -> None:
    """[Note: a backward that raised on some ranks]
    A backward that raises part way has issued some of its collectives. Where every rank raised at the same point
    (an error every rank's hook hits, the same shapes on every rank) those pair among themselves and the ranks can
    go on together; where one rank raised alone (an out-of-memory error on its long batch) the others wait on
    collectives it will never issue, and its next ones would pair with theirs: the replicas would silently diverge
    (stage 0, whose buckets have the same sizes) or wait out the deadline. So before going on (`zero_grad`,
    `load_checkpoint`) a rank whose backward raised posts on the rendezvous store how many collectives it issued and
    waits, up to the process group's timeout, for every rank's post: the same count everywhere goes on; otherwise
    this rank stops with a line naming the ranks (and posts under the deadline topic, so that the ranks left waiting
    name it when their own collectives time out)."""
    # every rank of the job, not only the engine's group: under tensor parallelism that is the data-parallel group
    # (of one rank where autotp_size is the world), while the model-parallel peers wait in the backward's collectives
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    event = next(_RAISES)
    keys = {rank: f"zeroshard/raised/{event}/{rank}" for rank in range(world)}
    waiting = f"zeroshard/deadline/{dist.get_rank()}"  # what named_on_timeout reads on the ranks left waiting
    store.set(waiting, f"its backward raised; it stopped in {call}, waiting for every rank's backward to raise too")
    # the engine's group's count (a sub-group's collectives, hpZ's or experts', are not in it)
    store.set(keys[dist.get_rank()], str(comm.issued))
    try:
        store.wait(list(keys.values()), datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        try:
            missing: list[int] | str = [rank for rank, key in keys.items() if not store.check([key])]
        except RuntimeError:  # the store itself went away: a rank stopped (its own deadline, a crash)
            missing = "others (the job's store went away while it waited: a rank stopped)"
        raise CollectiveTimeoutError(
            f"{call}: this rank's backward raised part way and that of rank(s) {missing} did not within "
            f"{timeout_s:.0f}s (the collective timeout): they wait on collectives this rank will never issue, so "
            "the ranks cannot go on together. The job stops here; restart from the last checkpoint (a batch that "
            "fails on one rank can be skipped only where every rank skips it)"
        ) from err
    store.delete_key(waiting)
    issued = {rank: int(store.get(key)) for rank, key in keys.items()}
    if len(set(issued.values())) > 1:
        raise CollectiveMismatchError(
            f"{call}: the backward raised on every rank, but at different points ("
            + ", ".join(f"rank {rank} after {n} collectives" for rank, n in issued.items())
            + "): their collectives do not pair, so the ranks cannot go on together. The job stops here; restart "
            "from the last checkpoint"
        )
