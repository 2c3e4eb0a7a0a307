"""Give freed host memory back to the operating system: the allocator policy of every CPU run and NVMe store.

[Note: glibc's mmap threshold]
glibc serves allocations above its mmap threshold (128 KiB at start) with mmap and unmaps them on free;
but each such free raises the threshold to the freed size (up to 32 MiB on 64-bit), after which
allocations of that size come from the heap, where freed memory stays in the process. NVMe offload frees
and re-allocates the same storages every step, so the heap would grow to hold all of them and the
process's RSS would approach what the offload was meant to save (measured: 1.45x the optimizer state
instead of 0.68x on a 105M-parameter model). Training on the CPU does the same with stage 3's gathered
units, reduction buffers and autograd's gradients: a 25M-parameter model's stage-3 RSS rose step after step
and ended above stage 0's (benchmarks/resident_memory.py, docs/benchmarks_resident.md). Fixing the threshold (which
disables the adjustment) keeps large storages on mmap, so RSS follows the live tensors. A
MALLOC_MMAP_THRESHOLD_ set by the user wins; ZEROSHARD_HOST_ALLOC=glibc leaves glibc's default alone.

The price is a page fault for every 4 KiB of every large tensor allocated afresh: activations, autograd's
gradients, logits. On a 5.3M-parameter GPT (2 ranks, micro-batch 2 x 128 tokens) a stage-0 step took 27,700
minor faults with the policy and none without, and 1.3-2.4x the time on this 2-core machine (issue 21: it was
most of "stage 0 costs 20% more than DDP"). Stages 0-2 keep their buffers for the whole run (flat parameters,
gradients and optimizer state are allocated once), so their RSS does not climb under glibc's default; the
policy is therefore applied where it pays for itself: stage 3 (units gathered and released every step) and
any offload (storages freed and re-read every step), or everywhere with ZEROSHARD_HOST_ALLOC=fixed (the
resident-memory benchmark compares stages under one policy that way).

[Note: huge pages for fresh host buffers]
Under the fixed threshold every large buffer comes from a fresh mmap, and the kernel maps and zeroes it one 4 KiB
page fault at a time as it is first written: a stage-3 unit gathered, a gradient shard, a reduction's staging
buffer (the `BufferPool` of every stage), every step. Where transparent huge pages are on for advised memory
(`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, as on Debian and Ubuntu; with "always" the advice changes
nothing), `madvise(MADV_HUGEPAGE)` on such a buffer before it is written makes each fault map 2 MiB (a fresh 64 MiB
buffer: 16,386 faults and 26.5 ms to write, 545 and 4.4 ms advised). `fresh` advises zeroshard's own host buffers
of 4 MiB and more this way (the fsdp2 backend's too: FSDP2's whole-unit all-gather outputs and reduce-scatter
inputs, which it asks the backend's collectives to allocate, fsdp2/comms.py), and only the 2 MiB-aligned interior
of a buffer that is its own mapping: the fixed threshold is in force, no other allocator is interposed (jemalloc or
tcmalloc preloaded keep freed memory, which the advice would follow into tensors written in part: RSS measured 450
MiB against 247 MiB), and glibc's chunk header says it was mapped for this allocation (not heap memory, which
khugepaged could fill in). The resident set is unchanged, since these buffers are written whole; the cost is that a
fault may compact memory to find a huge page (`defrag` = madvise). Tensors torch allocates itself (activations,
autograd's gradients, FSDP2's unsharded parameters) are advised only with `THP_MEM_ALLOC_ENABLE=1`, which torch
reads at its first CPU allocation, or glibc's `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, read at the process's start:
both before a library that is given a model can act; docs/design.md has the measurements. NVMe entries read back
are not advised: their reads are bound by the disk (benchmarks/infinity.py with 4 layers of width 1536: step times
the same within noise).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from functools import cache
from typing import Any

import torch

from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
DEFAULT_THRESHOLD = 256 << 10
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux
_ADVISED_FROM = max(2 * _HUGE_PAGE, DEFAULT_THRESHOLD)  # smaller: little aligned interior; always a mapping
_IS_MMAPPED = 2  # glibc's chunk-size flag


def fix_mmap_threshold() -> bool:
    """Set glibc's mmap threshold to DEFAULT_THRESHOLD bytes, once per process: [Note: glibc's mmap threshold].
    False where that is not possible (not glibc) or not wanted (MALLOC_MMAP_THRESHOLD_ set by the user,
    ZEROSHARD_HOST_ALLOC=glibc); the outcome is logged once at debug level."""
    return _fix_once()


def apply_host_policy(device: torch.device, churns: bool) -> bool:
    """The allocator policy for a run on `device` ([Note: glibc's mmap threshold]): on the CPU when the run
    allocates and frees large storages every step (`churns`: stage 3, offload) or ZEROSHARD_HOST_ALLOC=fixed."""
    wanted = churns or os.environ.get("ZEROSHARD_HOST_ALLOC", "").lower() == "fixed"
    return device.type == "cpu" and wanted and fix_mmap_threshold()


@cache
def _fix_once() -> bool:
    threshold = DEFAULT_THRESHOLD
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        logger.debug(
            "glibc mmap threshold: MALLOC_MMAP_THRESHOLD_=%s (set by the user) kept",
            os.environ["MALLOC_MMAP_THRESHOLD_"],
        )
        return False
    if os.environ.get("ZEROSHARD_HOST_ALLOC", "").lower() == "glibc":
        logger.debug("glibc mmap threshold: left dynamic (ZEROSHARD_HOST_ALLOC=glibc)")
        return False
    done = sys.platform.startswith("linux") and _mallopt(_M_MMAP_THRESHOLD, threshold)
    logger.debug("glibc mmap threshold: %s", f"fixed at {threshold} bytes" if done else "not changed (no mallopt)")
    return done


def fresh(storage: torch.UntypedStorage, nbytes: int) -> None:
    """Give a released (empty) `storage` `nbytes` of new memory (`resize_`), advised for huge pages where it is a
    large host buffer of its own mapping: [Note: huge pages for fresh host buffers]."""
    empty = storage.nbytes() == 0  # a storage resized with its data is copied: written already
    storage.resize_(nbytes)
    if empty and _advisable(storage.device, nbytes):
        address = storage.data_ptr()
        if _own_mapping(address):
            _advise_huge(address, nbytes)


def fresh_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.empty(numel)`, advised as `fresh` advises a storage where that applies."""
    tensor = torch.empty(0 if _advisable(device, numel * dtype.itemsize) else numel, dtype=dtype, device=device)
    if tensor.numel() == numel:  # torch.empty's own buffer (e.g. NaN-filled under deterministic algorithms)
        return tensor
    fresh(tensor.untyped_storage(), numel * tensor.element_size())
    return tensor.set_(tensor.untyped_storage(), 0, (numel,), (1,))  # type: ignore[call-overload]


def _advisable(device: torch.device, nbytes: int) -> bool:
    return device.type == "cpu" and nbytes >= _ADVISED_FROM and _policy_in_force()


def _policy_in_force() -> bool:
    """Whether this process fixed the threshold (`fix_mmap_threshold` ran and succeeded) and glibc's malloc is the
    one serving torch (no allocator interposed); asks nothing of glibc."""
    return _fix_once.cache_info().currsize > 0 and _fix_once() and _glibc_serves()


@cache
def _glibc_serves() -> bool:
    """Whether torch's `posix_memalign` resolves to glibc's, not to a preloaded allocator's."""
    try:
        seen = ctypes.cast(ctypes.CDLL(None).posix_memalign, ctypes.c_void_p).value
        ours = ctypes.cast(_libc().posix_memalign, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return False
    return seen is not None and seen == ours


def _own_mapping(address: int) -> bool:
    """glibc's chunk header, the word before the memory it returned, has IS_MMAPPED (2) set when the chunk is a
    mapping of its own (read only where glibc serves: `_policy_in_force`)."""
    return bool(ctypes.c_size_t.from_address(address - ctypes.sizeof(ctypes.c_size_t)).value & _IS_MMAPPED)


def _advise_huge(address: int, nbytes: int) -> None:
    """MADV_HUGEPAGE over the 2 MiB-aligned interior of [address, address + nbytes), if there is one."""
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    madvise = _madvise()
    if madvise is not None and end > start:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_HUGEPAGE))  # advice only


@cache
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return _libc().madvise
    except (OSError, AttributeError):
        return None


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _mallopt(param: int, value: int) -> bool:
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    return bool(mallopt(ctypes.c_int(param), ctypes.c_int(value)))
