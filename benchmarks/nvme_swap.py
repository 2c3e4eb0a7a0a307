"""NVMe swap bandwidth: `NvmeSwapper` against the same disk's sequential bandwidth, measured in the same run.

    python -m benchmarks.nvme_swap --path /tmp --size-mb 1024            # markdown table on stdout
    python -m benchmarks.nvme_swap --path /mnt/nvme --json results.json

References (no page cache: O_DIRECT where the filesystem accepts it, else fsync + fadvise(DONTNEED); like
`dd oflag=direct` and like the swapper, O_DIRECT writes are timed without a final fsync):
- `raw dd`: one thread, one large aligned buffer, sequential pwrite/pread of 8 MiB blocks, like
  `dd bs=8M oflag=direct` -- the plain sequential bandwidth of the disk;
- `raw x4`: the same from 4 threads (many disks, virtual ones especially, need several requests in flight);
- `raw io_uring`: one ring with 32 requests in flight, only if the `liburing` package is importable.
The swapper writes then reads the same bytes as `--tensors` keys (all submitted, then `wait_all`), for each
mode x threads x block size: `in place` from and into 4096-aligned host tensors (no staging copy), `staged`
from and into unaligned ones, through a pool of `--buffer-count` x `--buffer-mb` staging buffers (the path a
device tensor takes). `first write` goes to new files; `write` and `read` to existing ones, as in every
training step after the first. Each configuration runs `--repeats` times, interleaved, and the median is
reported; the ratio is against the best raw reference of the same direction.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zeroshard.config import AioConfig
from zeroshard.offload.aio import IoMode, open_flags, pread_exact, probe_io_mode, pwrite_all
from zeroshard.offload.buffers import aligned_zeros
from zeroshard.offload.nvme import NvmeSwapper

MiB = 1 << 20
Timer = Callable[[], float]


# -- the machine -----------------------------------------------------------------------------------
def describe_disk(path: Path) -> dict[str, str]:
    """Filesystem type, `df -h` line and the block device behind `path` (model if /sys/block tells)."""
    info = {"path": str(path), "kernel": platform.release(), "cpus": str(os.cpu_count())}
    df = subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True, check=False).stdout.splitlines()
    if len(df) >= 2:
        info["df -hT"] = " ".join(df[1].split())
        info["fstype"] = df[1].split()[1]
    st = os.stat(path)
    sys_dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if sys_dev.exists():
        node = sys_dev.resolve()
        disk = node.parent if (node / "partition").exists() else node
        info["device"] = disk.name
        model = _read(disk / "device" / "model")
        vendor = _read(disk / "device" / "vendor")
        kind = "virtio block device" if "virtio" in str(disk) else ""
        info["model"] = " ".join(x for x in (model, kind, f"vendor {vendor}" if vendor else "") if x) or "unknown"
        info["rotational"] = _read(disk / "queue" / "rotational")
        info["scheduler"] = _read(disk / "queue" / "scheduler")
    return info


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# -- raw references --------------------------------------------------------------------------------
def raw_threads(file: Path, data: torch.Tensor, mode: IoMode, threads: int, block: int, write: bool) -> float:
    """Seconds to write or read `data` sequentially in `block` chunks from `threads` threads."""
    view = data.numpy().data
    fd = os.open(file, open_flags(mode, write), 0o600)
    offsets = range(0, len(view), block)

    def work(rank: int) -> None:
        for off in offsets[rank::threads]:
            if write:
                pwrite_all(fd, view[off : off + block], off)
            else:
                pread_exact(fd, view[off : off + block], off, file)

    try:
        start = time.perf_counter()
        pool = [threading.Thread(target=work, args=(r,)) for r in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if write and mode is IoMode.BUFFERED:
            os.fsync(fd)
        elapsed = time.perf_counter() - start
        _drop_cache(fd)
        return elapsed
    finally:
        os.close(fd)


def raw_uring(file: Path, data: torch.Tensor, mode: IoMode, depth: int, block: int, write: bool) -> float:
    """Seconds for the same transfer through one io_uring with `depth` requests in flight."""
    import liburing as uring  # optional: only for this reference row

    view = data.numpy().data
    fd = os.open(file, open_flags(mode, write), 0o600)
    ring, cqe = uring.Ring(), uring.Cqe()
    uring.io_uring_queue_init(depth, ring)
    try:
        start = time.perf_counter()
        offsets, keep, inflight = list(range(0, len(view), block)), [], 0
        while offsets or inflight:
            while offsets and inflight < depth:
                off = offsets.pop(0)
                iov = uring.Iovec([view[off : off + block]])
                keep.append(iov)
                sqe = uring.io_uring_get_sqe(ring)
                (uring.io_uring_prep_writev if write else uring.io_uring_prep_readv)(sqe, fd, iov, off)
                inflight += 1
            uring.io_uring_submit(ring)
            uring.io_uring_wait_cqe(ring, cqe)
            if cqe[0].res != block:
                raise OSError(f"io_uring {'write' if write else 'read'} returned {cqe[0].res}")
            uring.io_uring_cqe_seen(ring, cqe[0])
            inflight -= 1
        if write and mode is IoMode.BUFFERED:
            os.fsync(fd)
        elapsed = time.perf_counter() - start
        _drop_cache(fd)
        return elapsed
    finally:
        uring.io_uring_queue_exit(ring)
        os.close(fd)


def _drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


# -- the swapper ---------------------------------------------------------------------------------
def swapper_run(
    root: Path, data: torch.Tensor, out: torch.Tensor, mode: IoMode, threads: int, block: int, args: argparse.Namespace
) -> tuple[float, float, float]:
    """Seconds for the first swap_out of all keys (new files), then, as in every later training step, for
    swap_out over the existing files and for swap_in of all keys back into `out`."""
    aio = AioConfig(block_size=block, intra_op_parallelism=threads, queue_depth=1)  # `threads` requests in flight
    with NvmeSwapper(root, aio, args.buffer_count, args.buffer_mb * MiB, pin=True, mode=mode) as swapper:
        sources, targets = data.chunk(args.tensors), out.chunk(args.tensors)

        def timed(tensors: tuple[torch.Tensor, ...], write: bool) -> float:
            start = time.perf_counter()
            for i, tensor in enumerate(tensors):
                (swapper.swap_out if write else swapper.swap_in)(f"t{i}", tensor)
            swapper.wait_all()
            return time.perf_counter() - start

        first = timed(sources, write=True)
        timed(targets, write=False)  # also allocates the staging buffers
        wrote, read = timed(sources, write=True), timed(targets, write=False)
    if not torch.equal(data, out):
        raise AssertionError(f"swap round trip differs ({mode.value}, {threads} threads, {block} B blocks)")
    out.numpy().fill(0)
    return first, wrote, read


# -- the run ---------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="zeroshard_nvme_bench_", dir=args.path))
    try:
        probed = probe_io_mode(root)
        modes = [probed] + ([IoMode.BUFFERED] if args.buffered and probed is IoMode.DIRECT else [])
        nbytes = args.size_mb * MiB
        # Host memory as `aligned_zeros` gives it; where pages were first touched changes this VM's disk
        # bandwidth by up to 2x (see [Note: touch buffers before O_DIRECT]), so every row reads into `out`.
        data, out = aligned_zeros(nbytes, torch.uint8), aligned_zeros(nbytes, torch.uint8)
        data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))  # incompressible
        cases: dict[str, Callable[[], tuple[float, float, float]]] = {}
        raw_file = root / "raw.bin"

        raw_threads(raw_file, data, probed, 4, 8 * MiB, True)  # timed writes overwrite, as the swapper's do

        def raw(fn: Callable[..., float], n: int, block: int) -> Callable[[], tuple[float, float, float]]:
            def case() -> tuple[float, float, float]:
                wrote, read = fn(raw_file, data, probed, n, block, True), fn(raw_file, out, probed, n, block, False)
                return math.nan, wrote, read

            return case

        cases["raw dd (1 thread, 8 MiB)"] = raw(raw_threads, 1, 8 * MiB)
        cases["raw x4 (4 threads, 8 MiB)"] = raw(raw_threads, 4, 8 * MiB)
        if _have_liburing():
            cases["raw io_uring (depth 32, 1 MiB)"] = raw(raw_uring, 32, MiB)
            cases["raw io_uring (depth 32, 8 MiB)"] = raw(raw_uring, 32, 8 * MiB)
        # The same bytes at an address that is not 4096-aligned: every chunk goes through a staging buffer,
        # as a device tensor's would.
        data_u, out_u = aligned_zeros(nbytes + 64, torch.uint8)[64:], aligned_zeros(nbytes + 64, torch.uint8)[64:]
        data_u.copy_(data)
        variants = [(m, staged) for m in modes for staged in ((False, True) if m is IoMode.DIRECT else (False,))]
        for mode, staged in variants:
            src, dst = (data_u, out_u) if staged else (data, out)
            path = "staged" if staged else "in place"
            for threads in args.threads:
                for block_mb in args.block_mb:
                    plural = "s" * (threads > 1)
                    name = f"swapper {mode.name.lower()}, {path} ({threads} thread{plural}, {block_mb} MiB)"
                    cases[name] = functools.partial(swapper_run, root, src, dst, mode, threads, block_mb * MiB, args)
        times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in cases}
        for _ in range(args.repeats):
            for name, case in cases.items():
                times[name].append(case())
        rows = {}
        for name, samples in times.items():
            rows[name] = {
                "first_write_GBps": statistics.median(nbytes / f / 1e9 for f, _, _ in samples),
                "write_GBps": statistics.median(nbytes / w / 1e9 for _, w, _ in samples),
                "read_GBps": statistics.median(nbytes / r / 1e9 for _, _, r in samples),
            }
        best_raw_w = max(r["write_GBps"] for n, r in rows.items() if n.startswith("raw"))
        best_raw_r = max(r["read_GBps"] for n, r in rows.items() if n.startswith("raw"))
        for row in rows.values():
            row["write_ratio"] = row["write_GBps"] / best_raw_w
            row["read_ratio"] = row["read_GBps"] / best_raw_r
        return {
            "machine": describe_disk(Path(args.path)),
            "probed_mode": probed.value,
            "size_MiB": args.size_mb,
            "tensors": args.tensors,
            "buffers": f"{args.buffer_count} x {args.buffer_mb} MiB",
            "repeats": args.repeats,
            "rows": rows,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _have_liburing() -> bool:
    try:
        import liburing  # noqa: F401
    except ImportError:
        return False
    return True


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"Disk: `{m.get('df -hT', m['path'])}`; device {m.get('device', '?')} ({m.get('model', 'unknown')}, "
        f"rotational={m.get('rotational', '?')}, scheduler `{m.get('scheduler', '?')}`); kernel {m['kernel']}, "
        f"{m['cpus']} CPUs.",
        f"{result['size_MiB']} MiB as {result['tensors']} tensors, staging buffers {result['buffers']}, "
        f"median of {result['repeats']}; O_DIRECT probe: {result['probed_mode']}. `first write`: new files; "
        f"`write`/`read`: the files exist, as from the second training step on.",
        "",
        "| configuration | first write GB/s | write GB/s | read GB/s | write / best raw | read / best raw |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in result["rows"].items():
        ratios = f"{r['write_ratio']:.0%} | {r['read_ratio']:.0%}"
        first = "" if math.isnan(r["first_write_GBps"]) else f"{r['first_write_GBps']:.2f}"
        lines.append(f"| {name} | {first} | {r['write_GBps']:.2f} | {r['read_GBps']:.2f} | {ratios} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--path", default=tempfile.gettempdir(), help="directory on the disk to measure")
    parser.add_argument("--size-mb", type=int, default=1024, help="bytes moved per direction per run (MiB)")
    parser.add_argument("--tensors", type=int, default=8, help="keys the bytes are split into")
    parser.add_argument(
        "--threads", type=_ints, default=[1, 2, 4, 8], help="I/O threads = requests in flight, e.g. 1,2,4,8"
    )
    parser.add_argument("--block-mb", type=_ints, default=[1, 8], help="aio.block_size values (MiB), e.g. 1,8")
    parser.add_argument("--buffer-count", type=int, default=4)
    parser.add_argument("--buffer-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-buffered", dest="buffered", action="store_false", help="skip the buffered-mode rows")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(markdown(result))  # the benchmark's output is its table


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


if __name__ == "__main__":
    main()
