"""The host allocator policy ([Note: glibc's mmap threshold]) and huge-page advice for zeroshard's fresh host
buffers ([Note: huge pages for fresh host buffers]), read back from the kernel's own view (/proc/self/smaps).

Each case runs in a fresh interpreter: the policy changes glibc for the whole process, and the pytest process
must keep glibc's defaults for the tests after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

# Prints, for buffers given memory by `fresh`/`fresh_empty` and for one from torch.empty beside them, whether the
# kernel holds each one's 2 MiB-aligned interior as advised for huge pages (VmFlags "hg" on its mapping).
PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    from zeroshard.offload import host_memory as hm

    def advised(address, nbytes):
        start = -(-address // hm._HUGE_PAGE) * hm._HUGE_PAGE  # the aligned interior, where there is one
        start = start if start < address + nbytes else address
        lo, hi = 0, 0
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                elif head == "VmFlags:" and lo <= start < hi:
                    return "hg" in line.split()[1:]
        return False

    policy = hm.apply_host_policy(torch.device("cpu"), churns=sys.argv[1] == "1")
    big, small = 16 << 20, 1 << 20
    unit = torch.empty(0)
    hm.fresh(unit.untyped_storage(), big)
    pooled = hm.fresh_empty(big // 4, torch.float32, torch.device("cpu"))
    tiny = hm.fresh_empty(small // 4, torch.float32, torch.device("cpu"))
    plain = torch.empty(big // 4)
    pooled.fill_(1.0)
    print(json.dumps({
        "policy": policy,
        "shape": list(pooled.shape), "dtype": str(pooled.dtype), "nbytes": unit.untyped_storage().nbytes(),
        "sum": pooled.sum().item(),
        "unit": advised(unit.untyped_storage().data_ptr(), big),
        "pooled": advised(pooled.data_ptr(), big),
        "tiny": advised(tiny.data_ptr(), small),
        "plain": advised(plain.data_ptr(), big),
    }))
    """
)


def _probe(churns: bool, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "ZEROSHARD_HOST_ALLOC")}
    environ.update(env, PYTHONPATH=SRC)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if churns else "0"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0] if "[" in text else "absent"


needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc, madvise and /proc/self/smaps")


@needs_linux
@pytest.mark.skipif(_thp_mode() in ("never", "absent"), reason="transparent huge pages are off on this kernel")
def test_fresh_buffers_are_advised_for_huge_pages_under_the_policy() -> None:
    seen = _probe(churns=True)
    assert seen["policy"] is True
    assert seen["shape"] == [4 << 20] and seen["dtype"] == "torch.float32" and seen["nbytes"] == 16 << 20
    assert seen["sum"] == float(4 << 20)  # an ordinary buffer: written and read whole
    assert seen["unit"] and seen["pooled"]
    assert not seen["tiny"]  # below _ADVISED_FROM: left in 4 KiB pages
    assert not seen["plain"]  # torch's own allocations are not ours to advise


@needs_linux
@pytest.mark.parametrize(
    ("churns", "env"),
    [
        (False, {}),  # stages 0-2 on the CPU without offload: glibc's default, so the buffer may sit in the heap
        (True, {"ZEROSHARD_HOST_ALLOC": "glibc"}),
        (True, {"MALLOC_MMAP_THRESHOLD_": "33554432"}),  # the user's threshold: 16 MiB comes from the heap
    ],
)
def test_without_the_policy_nothing_is_advised(churns: bool, env: dict[str, str]) -> None:
    seen = _probe(churns, **env)
    assert seen["policy"] is False
    assert not seen["unit"] and not seen["pooled"]
    assert seen["sum"] == float(4 << 20)
