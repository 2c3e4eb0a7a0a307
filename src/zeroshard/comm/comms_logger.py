"""`comms_logger`: per-collective counts, message sizes, latency and bandwidth, DeepSpeed's CommsLogger table.

[Note: comms logger] `Collectives` (the one call site, [Note: one call site]) asks `should_profile(name)` before
each collective it issues; a profiled collective is waited for (an asynchronous one too, which removes its overlap,
as DeepSpeed's logger does) and its wall time recorded under DeepSpeed's name: `all_reduce`,
`reduce_scatter_tensor`, `all_gather_into_tensor`, `broadcast`. The message size is DeepSpeed's: the bytes of the
collective's `tensor` argument (the shard for an all-gather, the full input for a reduce-scatter, the tensor for an
all-reduce or broadcast). Bandwidths are in Gbps with nccl-tests' formulas: algbw = bytes moved / time (an
all-gather moves N shards, an all-reduce 2x), busbw = algbw x (N-1)/N (x 2(N-1)/N for all-reduce). One departure:
DeepSpeed multiplies a reduce-scatter's full input by N again, reporting N times its real bandwidth; we do not.
With one rank nothing is issued, so nothing is logged (as `CommStats` counts nothing).

`deepspeed.comm.log_summary()` names no engine, so each enabled logger is remembered in `LIVE` (weak references,
the one piece of module state here: DeepSpeed's API is global) and `comm/api.py` summarises those alive.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import torch

from zeroshard.config.monitor import CommsLoggerConfig
from zeroshard.errors import ConfigError
from zeroshard.reporting import report
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

# The names the engine's collectives are logged under, DeepSpeed's (prof_ops selects by them).
OP_NAMES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast")
# Every name deepspeed.comm logs under: prof_ops may list any (the engine issues only OP_NAMES).
DEEPSPEED_OP_NAMES = frozenset(
    OP_NAMES
    + ("all_gather", "reduce_scatter", "all_to_all_single", "all_to_all", "reduce", "gather", "scatter")
    + ("send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier")
    + ("broadcast_object_list", "all_gather_object", "all_reduce_coalesced", "inference_all_reduce")
)


def check_prof_ops(names: Iterable[str]) -> None:
    """`comms_logger.prof_ops` names collectives deepspeed.comm logs ([Note: blocks checked by their readers])."""
    unknown = sorted(set(names) - DEEPSPEED_OP_NAMES)
    if unknown:
        raise ConfigError(
            f"comms_logger.prof_ops: unknown collective(s) {unknown}; the engine issues {', '.join(OP_NAMES)}"
        )


_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)")


@dataclass
class OpRecord:
    """Every call of one collective with one message size."""

    latencies_ms: list[float] = field(default_factory=list)
    algbw_gbps: list[float] = field(default_factory=list)
    busbw_gbps: list[float] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.latencies_ms)


def bandwidths(op: str, msg_bytes: int, latency_ms: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in Gbps of one collective ([Note: comms logger])."""
    if latency_ms <= 0:
        return 0.0, 0.0
    moved = {"all_gather_into_tensor": msg_bytes * world_size, "all_reduce": 2 * msg_bytes}.get(op, msg_bytes)
    algbw = moved * 8 / (latency_ms * 1e6)
    return algbw, algbw if op == "broadcast" else algbw * (world_size - 1) / world_size


def convert_size(size_bytes: int) -> str:
    """DeepSpeed's human-readable size ("1.5 KB")."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def trim_mean(data: list[float], trim: float = 0.1) -> float:
    """Mean without the `trim` fraction at each end (DeepSpeed's outlier removal)."""
    if not data:
        return 0.0
    k = int(round(len(data) * trim))
    return statistics.fmean(sorted(data)[k : len(data) - k])


class _LiveLoggers:
    """The enabled loggers still alive, oldest first (weak references: an engine's end drops its logger)."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[CommsLogger]] = []

    def add(self, logger: CommsLogger) -> None:
        self._refs.append(weakref.ref(logger))

    def alive(self) -> list[CommsLogger]:
        self._refs = [r for r in self._refs if r() is not None]
        return [log for r in self._refs if (log := r()) is not None]


LIVE = _LiveLoggers()


class CommsLogger:
    """The records of the collectives one `Collectives` issued; `log_all()` prints DeepSpeed's table.

    Example:
        >>> engine.comms_logger.log_all()  # doctest: +SKIP
    """

    def __init__(self, config: CommsLoggerConfig, world_size: int, rank: int):
        check_prof_ops(config.prof_ops)
        self.enabled = bool(config.enabled)
        self.verbose = bool(config.verbose)
        self.debug = bool(config.debug)
        self.prof_all = bool(config.prof_all)
        self.prof_ops = list(config.prof_ops)
        self.world_size = world_size
        self.rank = rank
        self.comms_dict: dict[str, dict[int, OpRecord]] = {}
        self.min_across_ranks: Callable[[torch.Tensor], object] | None = None  # set by Collectives for stragglers
        if self.enabled:
            LIVE.add(self)

    # -- DeepSpeed's switches ----------------------------------------------------------------------------------
    def start_profiling_comms(self) -> None:
        self.prof_all = True

    def stop_profiling_comms(self) -> None:
        self.prof_all = False

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = sorted(set(self.prof_ops) | set(op_name_list))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        self.prof_ops = [op for op in self.prof_ops if op not in op_name_list]

    def should_profile(self, op: str) -> bool:
        return self.enabled and (self.prof_all or op in self.prof_ops)

    # -- records -----------------------------------------------------------------------------------------------
    def append(self, op: str, latency_ms: float, msg_bytes: int) -> None:
        """Record one call of `op` (`debug`: under `op | [Caller Func: f]`, f the caller outside comm/)."""
        name = f"{op} | [Caller Func: {_caller()}]" if self.debug else op
        algbw, busbw = bandwidths(op, msg_bytes, latency_ms, self.world_size)
        record = self.comms_dict.setdefault(name, {}).setdefault(msg_bytes, OpRecord())
        record.latencies_ms.append(latency_ms)
        record.algbw_gbps.append(algbw)
        record.busbw_gbps.append(busbw)
        if self.verbose:
            log_rank(
                logger,
                20,
                f"comm op: {name} | time (ms): {latency_ms:.2f} | msg size: {convert_size(msg_bytes)} | "
                f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}",
            )

    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        """DeepSpeed's raw form: {op: {msg_size: [count, [latencies], [algbws], [busbws]]}}."""
        return {
            op: {size: [r.count, list(r.latencies_ms), list(r.algbw_gbps), list(r.busbw_gbps)] for size, r in d.items()}
            for op, d in self.comms_dict.items()
        }

    def has_data(self) -> bool:
        return bool(self.comms_dict)

    def reset_data(self) -> None:
        self.comms_dict.clear()

    def get_operation_names(self) -> list[str]:
        return list(self.comms_dict)

    def get_total_operations(self) -> int:
        return sum(r.count for d in self.comms_dict.values() for r in d.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        if operation_name not in self.comms_dict:
            return None
        return {size: _summary(size, r) for size, r in sorted(self.comms_dict[operation_name].items())}

    # -- the table ---------------------------------------------------------------------------------------------
    def log_all(
        self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False
    ) -> dict[str, Any] | None:
        """Log DeepSpeed's summary table (every rank that calls it logs its own); `return_dict` returns it as
        DeepSpeed's dict. `show_straggler` takes the minimum latency over ranks: every rank must call it then."""
        summary = {op: self.get_operation_summary(op) or {} for op in self.comms_dict}
        lines = ["".join(f"{c: <20}" for c in (*_COLUMNS, "busbw_avg (Gbps)"))]
        for op, sizes in summary.items():
            lines.append(op)
            for s in sizes.values():
                lines.append(
                    f"{' ': <20}{s['msg_size_str']: <20}{s['count']: <20}{s['total_latency_ms']: <20.2f}"
                    f"{s['avg_latency_ms']: <20.2f}{s['tput_avg_gbps']: <20.2f}{s['busbw_avg_gbps']: <20.2f}"
                )
        stragglers = self._stragglers(lines) if show_straggler else None
        if print_log:  # asked for by name: shown whatever the log level ([Note: reports the log level does not hide])
            report("\n" + "\n".join(lines), ranks=None)
        if not return_dict:
            return None
        return {
            "summary": summary,
            "straggler_analysis": stragglers,
            "metadata": {"world_size": self.world_size, "rank": self.rank, "timestamp": datetime.now().isoformat()},
        }

    def _same_records_on_every_rank(self, snapshot: dict[str, dict[int, list[float]]]) -> bool:
        """Whether every rank logged the same (op, size, count) rows: the straggler reductions are one all-reduce per
        row, so rows that differ (an uneven all-to-all is logged at each rank's own size: Muon's exchange, MoE,
        Ulysses) would pair different all-reduces across ranks (a hang on NCCL). One min-reduction of a digest."""
        assert self.min_across_ranks is not None
        rows = [(op, size, len(latencies)) for op, sizes in snapshot.items() for size, latencies in sizes.items()]
        digest = int.from_bytes(hashlib.sha256(repr(rows).encode()).digest()[:6], "big")  # exact in float64
        probe = torch.tensor([digest, -digest], dtype=torch.float64)
        self.min_across_ranks(probe)
        return bool(probe[0] == -probe[1])  # the smallest digest is the largest: all equal

    def _stragglers(self, lines: list[str]) -> dict[str, dict[int, dict[str, Any]]]:
        if self.min_across_ranks is None:
            raise RuntimeError("comms logger: show_straggler needs the engine's collectives")
        lines += [
            "_______________________________",
            "Breakdown with straggler effect",
            "-------------------------------",
            "".join(
                f"{c: <20}"
                for c in (
                    "Comm. Op",
                    "Message Size",
                    "Count",
                    "Total comm lat(ms)",
                    "Total straggler(ms)",
                    "Avg comm lat(ms)",
                    "Avg straggler(ms)",
                )
            ),
        ]
        out: dict[str, dict[int, dict[str, Any]]] = {}
        # a copy: the reductions below are collectives this logger records too
        snapshot = {
            op: {size: list(r.latencies_ms) for size, r in sorted(d.items())} for op, d in self.comms_dict.items()
        }
        if not self._same_records_on_every_rank(snapshot):
            lines.append("(not computed: the ranks logged different collectives, e.g. all-to-alls of uneven sizes)")
            return out
        for op, sizes in snapshot.items():
            lines.append(op)
            out[op] = {}
            for size, latencies in sizes.items():
                lats = torch.tensor(latencies, dtype=torch.float64)
                mins = lats.clone()
                self.min_across_ranks(mins)
                straggle = (lats - mins).tolist()
                entry = {
                    "count": len(latencies),
                    "total_comm_lat_ms": float(mins.sum()),
                    "total_straggler_ms": float(sum(straggle)),
                    "avg_comm_lat_ms": trim_mean(mins.tolist()),
                    "avg_straggler_ms": trim_mean(straggle),
                    "msg_size_bytes": size,
                    "msg_size_str": convert_size(size),
                }
                out[op][size] = entry
                lines.append(
                    f"{' ': <20}{entry['msg_size_str']: <20}{len(latencies): <20}{entry['total_comm_lat_ms']: <20.2f}"
                    f"{entry['total_straggler_ms']: <20.2f}{entry['avg_comm_lat_ms']: <20.2f}"
                    f"{entry['avg_straggler_ms']: <20.2f}"
                )
        return out


def _summary(size: int, r: OpRecord) -> dict[str, Any]:
    return {
        "count": r.count,
        "total_latency_ms": sum(r.latencies_ms),
        "avg_latency_ms": trim_mean(r.latencies_ms),
        "tput_avg_gbps": trim_mean(r.algbw_gbps),
        "busbw_avg_gbps": trim_mean(r.busbw_gbps),
        "msg_size_bytes": size,
        "msg_size_str": convert_size(size),
    }


def _caller() -> str:
    """The first function on the stack outside zeroshard/comm (the code that asked for the collective)."""
    frame = sys._getframe(1)
    while frame.f_back is not None and "zeroshard/comm/" in frame.f_code.co_filename.replace("\\", "/"):
        frame = frame.f_back
    return frame.f_code.co_name
