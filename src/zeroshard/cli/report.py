"""`zeroshard report`: versions, communication backends, devices, pinned-memory and NVMe readiness.

Informational only, like `ds_report`: nothing here fails; every check says what it found. Package
versions come from the installed metadata (no imports), so an optional package that is missing or
broken costs nothing.
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.metadata
import json
import mmap
import os
import platform
import resource
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from zeroshard.cli.common import human_bytes, out

PACKAGES = ("zeroshard", "torch", "numpy", "transformers", "peft", "safetensors", "accelerate", "deepspeed", "tqdm")
OPTIONAL = ("tensorboard",)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: not applicable here
    detail: str

    def line(self) -> str:
        mark = {True: "[OKAY]", False: "[NO]  ", None: "[N/A] "}[self.ok]
        return f"  {self.name:<28} {mark} {self.detail}"


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        parents=parents,
        help="environment report: versions, backends, devices, pinned memory, NVMe readiness",
        description="Report versions, torch.distributed backends, devices, pinned-memory and NVMe/aio readiness.",
    )
    p.add_argument("--nvme-path", default=".", help="folder to test for O_DIRECT and free space (default: .)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    sections = {
        "versions": versions(),
        "backends": backends(),
        "devices": devices(),
        "pinned memory": pinned_memory(),
        "nvme / async io": nvme(args.nvme_path),
    }
    if args.json:
        out(json.dumps({k: [c.__dict__ for c in v] for k, v in sections.items()}, indent=2))
        return 0
    out("zeroshard report (informational; nothing here is an error)")
    for title, checks in sections.items():
        out(f"{title}:")
        for check in checks:
            out(check.line())
    return 0


def versions() -> list[Check]:
    checks = [Check("python", True, f"{sys.version.split()[0]} ({sys.executable})")]
    for name in PACKAGES + OPTIONAL:
        try:
            checks.append(Check(name, True, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            optional = name in OPTIONAL or name == "deepspeed"
            checks.append(Check(name, None if optional else False, "not installed" + (" (optional)" * optional)))
    import torch

    cuda = torch.version.cuda or getattr(torch.version, "hip", None)
    checks.append(Check("torch cuda/hip build", None if cuda is None else True, cuda or "CPU-only build"))
    checks.append(Check("platform", True, platform.platform()))
    return checks


def backends() -> list[Check]:
    import torch.distributed as dist

    if not dist.is_available():
        return [Check("torch.distributed", False, "not built into this torch")]
    out_: list[Check] = []
    for name, probe in (
        ("gloo", dist.is_gloo_available),
        ("nccl", dist.is_nccl_available),
        ("mpi", dist.is_mpi_available),
        ("ucc", getattr(dist, "is_ucc_available", lambda: False)),
    ):
        available = bool(probe())
        out_.append(Check(f"backend {name}", available, "available" if available else "not available"))
    import torch

    chosen = "nccl" if torch.cuda.is_available() else "gloo"
    out_.append(Check("zeroshard's choice here", True, f"{chosen} (NCCL on CUDA, gloo on CPU)"))
    return out_


def devices() -> list[Check]:
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    checks = [Check("cpu cores (usable)", True, f"{cpus}; torch threads {torch.get_num_threads()}")]
    meminfo = _meminfo()
    if meminfo:
        total, available = human_bytes(meminfo.get("MemTotal", 0)), human_bytes(meminfo.get("MemAvailable", 0))
        checks.append(Check("host memory", True, f"{total} total, {available} available"))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            checks.append(
                Check(
                    f"cuda:{i}",
                    True,
                    f"{props.name}, {human_bytes(props.total_memory)}, capability {props.major}.{props.minor}",
                )
            )
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        checks.append(Check("bf16 on GPU", native, "supported" if native else "emulated or no (train in fp16)"))
    else:
        checks.append(Check("cuda", None, "no CUDA device; zeroshard trains on CPU with gloo (fp32 is fastest)"))
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        checks.append(Check("mps", True, "Apple GPU available (not used by zeroshard)"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        checks.append(Check("CUDA_VISIBLE_DEVICES", True, visible or "(empty)"))
    return checks


def pinned_memory() -> list[Check]:
    import torch

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else human_bytes(soft)
    checks = [Check("locked-memory limit", True, f"ulimit -l: {limit}")]
    if not torch.cuda.is_available():
        checks.append(Check("pinned host buffers", None, "needs a CUDA device (pin_memory has no effect on CPU)"))
        return checks
    try:
        buf = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
        checks.append(Check("pinned host buffers", bool(buf.is_pinned()), "allocated and freed 64 MiB pinned"))
    except RuntimeError as err:
        checks.append(Check("pinned host buffers", False, f"allocation failed: {err}"))
    checks.append(_exact_pinning())
    return checks


def _exact_pinning() -> Check:
    """What offloaded model state uses ([Note: pinned memory without rounding] in offload/pinned.py)."""
    import torch

    from zeroshard.errors import ZeroshardError
    from zeroshard.offload.pinned import pinned_zeros

    name = "exact-size pinned state"
    try:
        state = pinned_zeros((64 << 20) + 4096, torch.uint8, fallback=False)
    except ZeroshardError as err:
        return Check(name, False, f"{err}")
    return Check(name, bool(state.is_pinned()), "registered and freed 64 MiB + 4 KiB (cudaHostRegister)")


def nvme(path: str) -> list[Check]:
    checks: list[Check] = []
    if not os.path.isdir(path):
        return [Check("nvme path", False, f"{path} is not a folder")]
    usage = shutil.disk_usage(path)
    checks.append(
        Check(
            "free disk",
            True,
            f"{human_bytes(usage.free)} free of {human_bytes(usage.total)} at {os.path.abspath(path)}",
        )
    )
    ok, detail = o_direct_supported(path)
    checks.append(Check("O_DIRECT writes", ok, detail))
    lib = ctypes.util.find_library("aio")
    checks.append(Check("libaio", lib is not None, lib or "not found (apt-get install libaio-dev)"))
    return checks


def o_direct_supported(path: str) -> tuple[bool, str]:
    """Whether an aligned 4 KiB O_DIRECT write works in `path` (tmpfs and some overlay filesystems refuse it)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return False, "this OS has no O_DIRECT"
    try:
        handle, name = tempfile.mkstemp(dir=path, prefix=".zeroshard_odirect_")
    except OSError as err:
        return False, f"cannot create a file in {path}: {err.strerror}"
    os.close(handle)
    try:
        fd = os.open(name, os.O_WRONLY | flag)
        try:
            block = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT requires
            os.write(fd, block)
        finally:
            os.close(fd)
        return True, f"aligned write ok in {os.path.abspath(path)}"
    except OSError as err:
        return False, f"{err.strerror} in {os.path.abspath(path)} (filesystem without direct I/O, e.g. tmpfs)"
    finally:
        os.unlink(name)


def _meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            rows = [line.split() for line in handle]
    except OSError:
        return {}
    return {row[0].rstrip(":"): int(row[1]) * 1024 for row in rows if len(row) >= 2 and row[1].isdigit()}
