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
from collections.abc import Iterator
from contextlib import contextmanager
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

    policy = hm.apply_host_policy(torch.device("cpu"), churns=sys.argv[1] == "1") and hm._policy_in_force()
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
    # torch's own advice (THP_MEM_ALLOC_ENABLE), a preloaded allocator or glibc settings would change what is seen
    unset = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES", "LD_PRELOAD", "ZEROSHARD_HOST_ALLOC")
    environ = {k: v for k, v in os.environ.items() if k not in (*unset, "THP_MEM_ALLOC_ENABLE")}
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
@pytest.mark.skipif(_thp_mode() == "absent", reason="no transparent huge pages in this kernel")
def test_fresh_buffers_are_advised_for_huge_pages_under_the_policy() -> None:
    seen = _probe(churns=True)
    assert seen["policy"] is True
    assert seen["shape"] == [4 << 20] and seen["dtype"] == "torch.float32" and seen["nbytes"] == 16 << 20
    assert seen["sum"] == float(4 << 20)  # an ordinary buffer: written and read whole
    assert seen["unit"] and seen["pooled"]
    assert not seen["tiny"]  # below _ADVISED_FROM (and without a 2 MiB-aligned interior)
    assert not seen["plain"]  # torch's own allocations are not ours to advise


@needs_linux
@pytest.mark.parametrize(
    ("churns", "env"),
    [
        # stages 0-2 on the CPU without offload: glibc's default, so the buffer may sit in the heap
        pytest.param(False, {}, marks=pytest.mark.slow),  # CI budget: the default suite in 15 minutes on 2 AVX2 cores
        pytest.param(
            True, {"ZEROSHARD_HOST_ALLOC": "glibc"}, marks=pytest.mark.slow
        ),  # CI budget: the default suite in 15 minutes on 2 AVX2 cores
        # the user's threshold: 16 MiB comes from the heap
        pytest.param(True, {"MALLOC_MMAP_THRESHOLD_": "33554432"}, marks=pytest.mark.slow),
    ],
)
def test_without_the_policy_nothing_is_advised(churns: bool, env: dict[str, str]) -> None:
    seen = _probe(churns, **env)
    assert seen["policy"] is False
    assert not seen["unit"] and not seen["pooled"]
    assert seen["sum"] == float(4 << 20)


# In-process: glibc is left alone; the policy and the system calls are replaced by recorders.

MiB = 1 << 20


@pytest.fixture
def advised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """`fresh` as under the policy, each `_advise_huge(address, nbytes)` recorded instead of made."""
    from zeroshard.offload import host_memory as hm

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(hm, "_policy_in_force", lambda: True)
    monkeypatch.setattr(hm, "_own_mapping", lambda address: True)
    monkeypatch.setattr(hm, "_advise_huge", lambda address, nbytes: calls.append((address, nbytes)))
    return calls


def test_only_empty_cpu_storages_of_4_mib_and_more_are_advised(advised: list[tuple[int, int]]) -> None:
    import torch

    from zeroshard.offload.host_memory import fresh

    below, at = torch.empty(0).untyped_storage(), torch.empty(0).untyped_storage()
    fresh(below, 4 * MiB - 1)
    fresh(at, 4 * MiB)
    assert advised == [(at.data_ptr(), 4 * MiB)]
    meta = torch.empty(0, device="meta").untyped_storage()
    fresh(meta, 16 * MiB)
    written = torch.ones(MiB).untyped_storage()  # resized with its data: copied, so touched already
    fresh(written, 16 * MiB)
    assert advised == [(at.data_ptr(), 4 * MiB)] and meta.nbytes() == written.nbytes() == 16 * MiB


def test_fresh_empty_is_torch_empty_where_nothing_is_advised(advised: list[tuple[int, int]]) -> None:
    import torch

    from zeroshard.offload.host_memory import fresh_empty

    big = fresh_empty(MiB, torch.float32, torch.device("cpu"))
    assert big.shape == (MiB,) and big.is_contiguous() and advised == [(big.data_ptr(), 4 * MiB)]
    assert torch.utils.deterministic.fill_uninitialized_memory  # torch's default
    with _deterministic():
        small = fresh_empty(16, torch.float32, torch.device("cpu"))  # torch.empty's own: NaN-filled here
        meta = fresh_empty(MiB, torch.float32, torch.device("meta"))
    assert small.isnan().all() and meta.shape == (MiB,) and len(advised) == 1


def test_the_advice_stays_inside_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroshard.offload import host_memory as hm

    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(
        hm, "_madvise", lambda: lambda start, length, advice: calls.append((start.value, length.value, advice.value))
    )
    huge = hm._HUGE_PAGE
    for address, nbytes in [
        (huge * 7 + 4096, 6 * MiB),
        (huge * 3, 4 * MiB),
        (huge * 5 + 64, 3 * MiB),
        (huge + 1, huge),
    ]:
        calls.clear()
        hm._advise_huge(address, nbytes)
        for start, length, advice in calls:
            assert start % huge == 0 and length % huge == 0 and length > 0 and advice == hm._MADV_HUGEPAGE
            assert address <= start and start + length <= address + nbytes
        interior = (address + nbytes) // huge * huge - -(-address // huge) * huge
        assert sum(length for _, length, _ in calls) == max(interior, 0)


@contextmanager
def _deterministic() -> Iterator[None]:
    import torch

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def test_fsdp2s_communication_buffers_are_advised(advised: list[tuple[int, int]]) -> None:
    """FSDP2 asks the fsdp2 backend's collectives for its whole-unit buffers (`allocate`): fresh every step."""
    import torch

    from zeroshard.comm.collectives import Collectives
    from zeroshard.fsdp2.comms import CountedAllGather, CountedReduceScatter

    comm = Collectives(None, 1, 0)
    out = CountedAllGather(comm).allocate((2, MiB), dtype=torch.float32, device=torch.device("cpu"))
    into = CountedReduceScatter(comm).allocate((MiB // 2,), dtype=torch.float32, device=torch.device("cpu"))
    assert out.shape == (2, MiB) and out.is_contiguous() and into.shape == (MiB // 2,)
    assert advised == [(out.data_ptr(), 8 * MiB)]  # 2 MiB: below the size worth advising
