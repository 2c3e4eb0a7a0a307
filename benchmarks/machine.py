"""A description of the machine a benchmark ran on, for the results page."""

from __future__ import annotations

import datetime
import os
import platform
from importlib import metadata
from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def total_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def version_of(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe() -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 1,
        "ram_gib": round(total_ram_bytes() / 2**30, 1),
        "python": platform.python_version(),
        "torch": version_of("torch"),
        "deepspeed": version_of("deepspeed"),
        "zeroshard": version_of("zeroshard"),
        "os": f"{platform.system()} {platform.release()}",
        "loadavg_1min": round(os.getloadavg()[0], 2),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def status_mib(key: str) -> int:
    """A field of /proc/self/status (VmRSS: resident now; VmHWM: its peak since start or the last clear_refs) in MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024
    raise KeyError(key)
