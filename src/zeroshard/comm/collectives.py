"""The one place zeroshard calls torch.distributed collectives.

[Note: one call site]
Every collective goes through `Collectives`, which
- hides API differences across torch versions and backends (`all_gather_single` in torch >= 2.13,
  `all_gather_into_tensor` before; no AVG/PREMUL_SUM on gloo, so averaging is SUM + a scale done by the caller,
  folded into one multiply at step time);
- counts what each rank sends, per collective kind, so tests and benchmarks read communication volume from one
  counter (`CommStats`); optionally times each collective for DeepSpeed's comms logger ([Note: comms logger]);
- optionally checks, before each collective, that every rank is about to issue the same one (`verify=True`): a
  mismatch raises `CollectiveMismatchError` naming the ranks instead of hanging.

Bytes are counted with the ring model nccl-tests calls "bus bytes": an all-reduce of S bytes sends 2·S·(N-1)/N per
rank, a reduce-scatter of an S-byte input and an all-gather of an S-byte output each send S·(N-1)/N, an all-to-all
of an S-byte input S·(N-1)/N (a rank keeps its own chunk). With one rank nothing is sent and nothing is called.

[Note: scopes]
Each `Collectives` has a scope, where its group's ranks sit: `intra_node` when they are all on one node,
`inter_node` when the group spans nodes (comm/topology.py's `NodeLayout` says which ranks share a node). Its
bytes count under its kind and under its scope (`CommStats.scopes`), so "the backward gathers send no byte
between nodes" is read from one counter. A collective over a group that spans nodes counts whole as inter-node:
the ring model has no notion of which links cross, so this is the bound the ZeRO++ claims are checked against.
Sub-group collectives (`Collectives.subgroup`) share the world's counters and comms logger.
"""

from __future__ import annotations

import sys
import time
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from zeroshard.comm.comms_logger import CommsLogger
from zeroshard.comm.in_flight import InFlight
from zeroshard.config.monitor import CommsLoggerConfig
from zeroshard.errors import SAME_MODULES, CollectiveMismatchError
from zeroshard.utils.chunks import greedy_chunks

_all_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# the same two under one name in every supported torch, for FSDP2's custom-collective hooks (fsdp2/comms.py)
all_gather_single = _all_gather_single
reduce_scatter_single = _reduce_scatter_single


class CollectiveKind(StrEnum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"


class Scope(StrEnum):
    """[Note: scopes] where a collective's group sits."""

    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


def scope_of(nodes: Any, ranks: list[int]) -> Scope:
    """The scope of a group of global `ranks` under a `NodeLayout` (comm/topology.py)."""
    return Scope.INTER_NODE if nodes.spans_nodes(ranks) else Scope.INTRA_NODE


class Handle(Protocol):
    def wait(self) -> Any: ...


class _Done:
    """Handle of a collective that completed synchronously (or had nothing to do)."""

    def wait(self, timeout: Any = None) -> bool:  # takes Work.wait's timeout (comm/divergence.py passes one)
        return True


@dataclass
class KindStats:
    calls: int = 0
    payload_bytes: int = 0
    bus_bytes: float = 0.0


@dataclass
class CommStats:
    """Per-kind counters, and the same per scope ([Note: scopes]); `snapshot()` gives the volume of one step."""

    kinds: dict[str, KindStats] = field(default_factory=lambda: {k.value: KindStats() for k in CollectiveKind})
    scopes: dict[str, dict[str, KindStats]] = field(
        default_factory=lambda: {s.value: {k.value: KindStats() for k in CollectiveKind} for s in Scope}
    )

    def record(
        self, kind: CollectiveKind, payload_bytes: int, bus_bytes: float, scope: Scope = Scope.INTRA_NODE
    ) -> None:
        for entry in (self.kinds[kind.value], self.scopes[scope.value][kind.value]):
            entry.calls += 1
            entry.payload_bytes += payload_bytes
            entry.bus_bytes += bus_bytes

    def scope_bus_bytes(self, scope: Scope | str, kind: CollectiveKind | str | None = None) -> float:
        """Bus bytes sent within `scope`, of one `kind` or of all."""
        entries = self.scopes[str(scope)]
        return entries[str(kind)].bus_bytes if kind is not None else sum(k.bus_bytes for k in entries.values())

    @property
    def total_bus_bytes(self) -> float:
        return sum(k.bus_bytes for k in self.kinds.values())

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {name: dict(vars(k)) for name, k in self.kinds.items()}

    def scope_snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        return {scope: {name: dict(vars(k)) for name, k in kinds.items()} for scope, kinds in self.scopes.items()}

    def reset(self) -> None:
        for k in [*self.kinds.values(), *(e for kinds in self.scopes.values() for e in kinds.values())]:
            k.calls, k.payload_bytes, k.bus_bytes = 0, 0, 0.0


class Collectives:
    """Collectives over one process group, counted and (optionally) verified across ranks."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        world_size: int,
        rank: int,
        verify: bool = False,
        logger: CommsLogger | None = None,
        scope: Scope = Scope.INTRA_NODE,
        stats: CommStats | None = None,
        in_flight: InFlight | None = None,
    ):
        """`stats` given: a sub-group's collectives counting into its parent's counters (`subgroup`), and sharing
        its `in_flight` ([Note: nothing held by a collective at exit])."""
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.verify = verify
        self.scope = scope
        self.stats = stats if stats is not None else CommStats()
        self.in_flight = in_flight if in_flight is not None else InFlight()
        self.logger = logger if logger is not None else CommsLogger(CommsLoggerConfig(), world_size, rank)
        if stats is None:  # a sub-group leaves the straggler reduction to the world's collectives
            self.logger.min_across_ranks = _min_across_ranks(weakref.ref(self))
        self.issued = 0  # collectives this object issued (its sub-groups count their own)

    def subgroup(self, group: dist.ProcessGroup | None, world_size: int, rank: int, scope: Scope) -> Collectives:
        """Collectives over a sub-group (`rank` within it), counted in this object's `stats` under `scope`."""
        return Collectives(
            group, world_size, rank, logger=self.logger, scope=scope, stats=self.stats, in_flight=self.in_flight
        )

    def global_rank(self, group_rank: int) -> int:
        """The global rank of `group_rank` in this group (what `broadcast`'s `src` takes)."""
        return _global_rank(self.group, group_rank)

    # -- collectives -------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, label: str = "") -> Handle:
        self._check(CollectiveKind.ALL_REDUCE, tensor, label)
        if self.world_size == 1:
            return _Done()
        self._count(CollectiveKind.ALL_REDUCE, tensor, rounds=2)
        return self._issue(
            "all_reduce",
            (tensor,),
            lambda a: dist.all_reduce(tensor, op=_reduce_op(op), group=self.group, async_op=a),
            async_op,
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        label: str = "",
        input_is_scratch: bool = False,
    ) -> Handle:
        """Sum `input` (N equal chunks) over ranks; this rank's chunk lands in `output`. With `input_is_scratch`
        the caller no longer needs `input`: on gloo it is then reduced in place ([Note: gloo in place])."""
        _check_chunks("reduce_scatter", "input", input, output, self.world_size)
        self._check(CollectiveKind.REDUCE_SCATTER, input, label)
        if self.world_size == 1:
            return _alone(output, input)
        self._count(CollectiveKind.REDUCE_SCATTER, input)
        if input_is_scratch and self._in_place_on_host(input):
            call: Callable[[bool], Any] = lambda a: self._reduce_in_place(output, input, a)  # noqa: E731
            return self._issue("reduce_scatter_tensor", (input,), call, async_op, tracked=False)
        call = lambda a: _reduce_scatter_single(  # noqa: E731
            output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=a
        )
        return self._issue("reduce_scatter_tensor", (input, output), call, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, label: str = "") -> Handle:
        """Concatenate every rank's `input` into `output`; `input` may be this rank's chunk of `output`."""
        _check_chunks("all_gather", "output", output, input, self.world_size)
        self._check(CollectiveKind.ALL_GATHER, output, label)
        if self.world_size == 1:
            return _alone(output, input)
        self._count(CollectiveKind.ALL_GATHER, output)
        if self._in_place_on_host(output):
            call: Callable[[bool], Any] = lambda a: self._gather_in_place(output, input, a)  # noqa: E731
            return self._issue("all_gather_into_tensor", (input,), call, async_op, tracked=False)
        call = lambda a: _all_gather_single(output, input, group=self.group, async_op=a)  # noqa: E731
        return self._issue("all_gather_into_tensor", (input, output), call, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False, label: str = "") -> Handle:
        self._check(CollectiveKind.BROADCAST, tensor, label)
        if self.world_size == 1:
            return _Done()
        self._count(CollectiveKind.BROADCAST, tensor)
        return self._issue(
            "broadcast", (tensor,), lambda a: dist.broadcast(tensor, src=src, group=self.group, async_op=a), async_op
        )

    def broadcast_coalesced(
        self,
        tensors: list[torch.Tensor],
        src: int,
        via: torch.device | None = None,
        label: str = "",
        bucket_bytes: int | None = None,
    ) -> None:
        """`tensors` from rank `src`, one flat broadcast per dtype (per `bucket_bytes` of it, where given: a whole
        model need not be one buffer on the device); `via`: the device the flat buffer travels through (NCCL moves
        device memory only), the tensors staying where they are."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        limit = bucket_bytes if bucket_bytes is not None else sys.maxsize
        chunks = [[same[i] for i in chunk] for dtype in sorted(by_dtype, key=str) for same in [by_dtype[dtype]]
                  for chunk in greedy_chunks([t.nbytes for t in same], limit, close="before")]  # fmt: skip
        for group in chunks:
            flat = _flatten_dense_tensors(group)
            flat = flat.to(via) if via is not None else flat
            self.broadcast(flat, src=src, label=label)
            for t, synced in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                t.copy_(synced)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, label: str = "") -> Handle:
        """Equal splits: chunk j of `input` goes to rank j, chunk i of `output` comes from rank i."""
        if output.numel() != input.numel() or input.numel() % self.world_size:
            raise ValueError(f"all_to_all: {input.numel()} elements in, {output.numel()} out, over {self.world_size}")
        self._check(CollectiveKind.ALL_TO_ALL, input, label)
        if self.world_size == 1:
            return _alone(output, input)
        self._count(CollectiveKind.ALL_TO_ALL, input)
        return self._issue(
            "all_to_all_single",
            (input, output),
            lambda a: dist.all_to_all_single(output, input, group=self.group, async_op=a),
            async_op,
        )

    def all_to_all_uneven(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        label: str = "",
    ) -> Handle:
        """Rows (dim 0) `input_splits[j]` of `input` go to rank j; `output_splits[i]` rows come from rank i (an
        MoE exchange: the split sizes differ by rank, zero included). Synchronous."""
        if sum(input_splits) != input.shape[0] or sum(output_splits) != output.shape[0]:
            raise ValueError(f"all_to_all_uneven: splits {input_splits}/{output_splits} do not match the rows")
        # the fingerprint carries no numel: ranks legitimately send different amounts
        self._check(CollectiveKind.ALL_TO_ALL, input.new_empty(0), label)
        if self.world_size == 1:
            return _alone(output, input)
        row_bytes = _nbytes(input) // max(1, input.shape[0])
        sent = row_bytes * (input.shape[0] - input_splits[self.rank])
        self.stats.record(CollectiveKind.ALL_TO_ALL, _nbytes(input), float(sent), self.scope)
        return self._issue(
            "all_to_all_single",
            (input, output),
            lambda a: dist.all_to_all_single(
                output,
                input,
                output_split_sizes=output_splits,
                input_split_sizes=input_splits,
                group=self.group,
                async_op=a,
            ),
            False,
        )

    def any_true(self, flag: bool, device: torch.device) -> bool:
        """True on every rank if `flag` is true on any rank (one tiny MAX all-reduce)."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        self.all_reduce(t, op="max")
        return bool(t.item() > 0)

    # -- internals ---------------------------------------------------------------------------------
    def _in_place_on_host(self, whole: torch.Tensor) -> bool:
        """[Note: gloo in place]
        gloo's `reduce_scatter_tensor` and `all_gather_into_tensor` copy the whole message into temporaries of
        its size (measured on 2 ranks, 12 MiB fp32: +15 MiB and +14 MiB peak resident memory per call) and are
        slower than their parts: N `reduce`s of the input's chunks, each to its owner, and N `broadcast`s of the
        output's chunks, each from its owner, work in the caller's buffers (+2 to +5 MiB) and took 0.4-0.6x the
        time on 2 and 4 ranks. The bytes each rank receives are the same, and so is the counted volume. A
        `reduce` leaves partial sums in the other ranks' chunks of its input, so the reduce-scatter takes this
        path only when the caller says the input is scratch. With more than two ranks gloo's reduce adds in
        another order than its reduce-scatter: results may differ in the last bit. NCCL and other backends
        keep the fused collectives."""
        return whole.device.type == "cpu" and dist.get_backend(self.group) == "gloo"

    def _reduce_in_place(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Any:
        chunks = list(input.view(self.world_size, -1))  # the very views handed to the backend
        works = self.in_flight.issue(
            chunks,
            lambda: [
                dist.reduce(chunks[owner], dst=_global_rank(self.group, owner), group=self.group, async_op=True)
                for owner in range(self.world_size)
            ],
        )
        mine = chunks[self.rank]
        return Joined(works, lambda: output.copy_(mine) if output.data_ptr() != mine.data_ptr() else None, async_op)

    def _gather_in_place(self, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Any:
        return gather_in_place(output, input, self.group, self.rank, self.world_size, async_op, self.in_flight)

    @property
    def _ring_fraction(self) -> float:
        return (self.world_size - 1) / self.world_size

    def _issue(
        self,
        name: str,
        tensors: tuple[torch.Tensor, ...],
        call: Callable[[bool], Any],
        async_op: bool,
        tracked: bool = True,
    ) -> Handle:
        """Issue `call(async_op)` over `tensors` (the message first); when the comms logger profiles `name`, wait
        for it and record its wall time and the message's bytes ([Note: comms logger]). Unless `call` follows its
        own (`tracked=False`), `tensors` are followed to exit ([Note: nothing held by a collective at exit])."""
        followed = tensors if tracked else ()
        message = tensors[0]
        if not self.logger.should_profile(name):
            return _issued(self.in_flight.issue(followed, lambda: call(async_op)), async_op)
        on_device = message.device.type != "cpu"
        if on_device:  # time the collective, not the work queued before it
            torch.accelerator.synchronize(message.device)
        start = time.perf_counter()
        work = self.in_flight.issue(followed, lambda: call(async_op))
        if async_op:
            work.wait()
        if on_device:
            torch.accelerator.synchronize(message.device)
        self.logger.append(name, (time.perf_counter() - start) * 1e3, _nbytes(message))
        return _Done()

    def _count(self, kind: CollectiveKind, tensor: torch.Tensor, rounds: int = 1) -> None:
        """Count a collective over `tensor`: its bytes, and `rounds` ring passes of bus bytes (module docstring)."""
        nbytes = _nbytes(tensor)
        self.stats.record(kind, nbytes, rounds * nbytes * self._ring_fraction, self.scope)

    def _check(self, kind: CollectiveKind, tensor: torch.Tensor, label: str = "") -> None:
        """With `verify`, all-gather a fixed-size fingerprint (seq, kind, numel, dtype, label hash) and
        compare across ranks before the real collective: a mismatch is raised on every rank, naming
        what each rank was about to do, instead of a hang or a backend abort."""
        self.issued += 1
        if not self.verify or self.world_size == 1:
            return
        code, dtype = zlib.crc32(label.encode()), zlib.crc32(str(tensor.dtype).encode())
        mine = torch.tensor(
            [self.issued, list(CollectiveKind).index(kind), tensor.numel(), dtype, code],
            dtype=torch.int64,
            device=tensor.device,
        )
        everyone = torch.empty(self.world_size * 5, dtype=torch.int64, device=tensor.device)
        with torch.profiler.record_function("zeroshard.verify_collective"):  # a synchronous round trip each
            _all_gather_single(everyone, mine, group=self.group)
            rows = everyone.view(self.world_size, 5).tolist()
        if all(row == rows[0] for row in rows):
            return
        labels = self._exchange_labels(label, tensor.device)
        described = "; ".join(
            f"rank {r}: #{row[0]} {list(CollectiveKind)[row[1]].value} numel={row[2]}"
            + (f" ({labels[r]})" if labels[r] else "")
            for r, row in enumerate(rows)
        )
        raise CollectiveMismatchError(
            f"ranks diverged: they are about to issue different collectives ({described}): the ranks took "
            f"different code paths. {SAME_MODULES}"
        )

    def _exchange_labels(self, label: str, device: torch.device) -> list[str]:
        width = 96
        raw = label.encode()[:width].ljust(width, b"\0")
        mine = torch.tensor(list(raw), dtype=torch.uint8, device=device)
        everyone = torch.empty(self.world_size * width, dtype=torch.uint8, device=device)
        _all_gather_single(everyone, mine, group=self.group)
        rows = everyone.view(self.world_size, width).tolist()
        return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows]


def _min_across_ranks(ref: weakref.ref[Collectives]) -> Callable[[torch.Tensor], None]:
    """The comms logger's straggler reduction; weak, so a logger alive in comms_logger.LIVE keeps no engine alive."""

    def reduce(t: torch.Tensor) -> None:
        comm = ref()
        if comm is None:
            raise RuntimeError("comms logger: its engine's collectives are gone (the engine was destroyed)")
        nccl = comm.world_size > 1 and "nccl" in str(dist.get_backend(comm.group))  # (also "cuda:nccl"): device only
        moved = t.to(torch.device("cuda", torch.cuda.current_device())) if nccl else t
        comm.all_reduce(moved, op="min", label="comms_logger stragglers")
        if moved is not t:
            t.copy_(moved)

    return reduce


def _reduce_op(op: str) -> dist.ReduceOp.RedOpType:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"unsupported reduce op {op!r}; expected one of {sorted(ops)}")
    return ops[op]


def _check_chunks(op: str, role: str, whole: torch.Tensor, chunk: torch.Tensor, world_size: int) -> None:
    """ValueError unless `whole` holds exactly one `chunk` per rank."""
    if whole.numel() != chunk.numel() * world_size:
        raise ValueError(f"{op}: {role} has {whole.numel()} elements, expected {world_size} x {chunk.numel()}")


def _alone(output: torch.Tensor, input: torch.Tensor) -> Handle:
    """A reduce-scatter or all-gather over one rank: `input` is the result (nothing to do when it is `output`)."""
    if output.data_ptr() != input.data_ptr():
        output.data.copy_(input)  # .data: no version bump on buffers autograd saved views of
    return _Done()


def _global_rank(group: Any, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (`src`/`dst` take global ranks in every supported torch)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def gather_in_place(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any,
    rank: int,
    world_size: int,
    async_op: bool,
    in_flight: InFlight,
) -> Any:
    """All-gather as one broadcast of each rank's chunk of `output`, from that rank ([Note: gloo in place]); `rank`
    is this process's rank in `group`. Also FSDP2's all-gather on gloo (fsdp2/comms.py)."""
    chunks = list(output.view(world_size, -1))  # the very views handed to the backend
    if chunks[rank].data_ptr() != input.data_ptr():
        chunks[rank].data.copy_(input.reshape(-1))  # .data: [Note: gathered storage] views
    works = in_flight.issue(
        chunks,
        lambda: [
            dist.broadcast(chunks[owner], src=_global_rank(group, owner), group=group, async_op=True)
            for owner in range(world_size)
        ],
    )
    return Joined(works, lambda: None, async_op)


class Joined:
    """Several collectives issued as one: `wait` waits for each, then runs `finish` once. Synchronous when not
    `async_op` (it has waited before it is returned)."""

    def __init__(self, works: list[Any], finish: Callable[[], Any], async_op: bool):
        self._works = works
        self._finish: Callable[[], Any] | None = finish
        if not async_op:
            self.wait()

    def wait(self, timeout: Any = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True


def _issued(work: Any, async_op: bool) -> Handle:
    """The handle of a collective just issued (a synchronous one has already finished)."""
    return work if async_op else _Done()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
