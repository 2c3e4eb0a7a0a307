"""Pinned host memory of exactly the size asked, for model states that live for the whole run.

[Note: pinned memory without rounding]
torch's pinned host allocator (`pin_memory=True`) rounds every allocation up to the next power of two and keeps a
freed block pinned in its cache for a later allocation of that rounded size: a good trade for staging buffers that
come and go, pure loss for model states. A Llama-2-7B-wide decoder layer's fp32 master shard (202M elements, 808 MB)
takes 1 GiB that way, and issue 13's optimizer-offload row measured 19 bytes of host VmHWM per parameter where its
states are 16 (the pinned fp32 masters and gradient copies each a third over). With the host as the limit of the
offload rows, that is Llama-2-7B fitting in 128 GiB with its optimizer and parameters on the host, or not.
`pinned_zeros` pins such state itself: an anonymous private mapping of exactly the bytes (page-aligned, zero-filled),
page-locked with `cudaHostRegister` and unlocked when the last tensor viewing it is freed (the tensor holds the
mapping through the buffer protocol, `torch.frombuffer`). The mapping is kept out of forked children (a DataLoader's
workers): pages shared copy-on-write with one could leave the device reading a page the parent no longer writes. The
driver reports registered memory as pinned host memory, so `is_pinned()` is true and copies to and from it run
asynchronously, as from `cudaHostAlloc`'s. Below `EXACT_FROM` bytes torch's allocator serves (its rounding costs
little there). Such storages cannot be resized: state swapped to NVMe (freed and re-allocated around each use) keeps
torch's allocator (`NvmeTier`), and `engine.offload_states` leaves state that lives off the device where it is; its
own host copies are exact-size pinned buffers too, kept from one offload to the next (offload/states.py).
The unregistration runs on the registering device, after that device's work is done, from whichever thread frees the
memory; at interpreter exit it is left to the driver. A registration the driver refuses falls back to torch's
allocator with one warning naming the cause (the thread's CUDA error is cleared first, so it cannot surface at an
unrelated operation; `zeroshard report` tries a registration up front). ZEROSHARD_PINNED=torch leaves all pinning to
torch's allocator.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from zeroshard.errors import ZeroshardError
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

EXACT_FROM = 1 << 20  # bytes: smaller pinned tensors come from torch's allocator


@dataclass(frozen=True)
class HostRegistry:
    """Page-locks host memory for the device (`register(address, nbytes)` -> None or the driver's error text) and
    unlocks it (`unregister(address)`): the CUDA runtime's calls, or a stand-in in tests."""

    register: Callable[[int, int], str | None]
    unregister: Callable[[int], object]


def cuda_registry() -> HostRegistry:
    """The CUDA runtime's registration, on the current device (portable: valid in every context); the unregistration
    runs on that device whichever thread frees the memory, after that device's work is done."""
    cudart = torch.cuda.cudart()
    device = torch.cuda.current_device()
    synchronize, on_device = torch.cuda.synchronize, torch.cuda.device

    def register(address: int, nbytes: int) -> str | None:
        error = cudart.cudaHostRegister(address, nbytes, _REGISTER_PORTABLE)
        if error == cudart.cudaError.success:
            return None
        _clear_last_error()
        return f"{cudart.cudaGetErrorString(error)}, cudaError {int(error)}"

    def unregister(address: int) -> None:
        with on_device(device):
            try:
                synchronize(device)  # no copy may still read or write the memory (freed at teardown: cheap)
            finally:
                cudart.cudaHostUnregister(address)

    return HostRegistry(register, unregister)


_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def _clear_last_error() -> None:
    """A failed runtime call leaves the thread's last error set, and torch's next kernel launch check would raise it
    at an unrelated operation; a launch that raises it here clears it (torch binds no cudaGetLastError)."""
    try:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    except RuntimeError:
        pass


class _Mapping(mmap.mmap):
    """Anonymous memory, unlocked (when it was locked) before it is unmapped."""

    unlock: Callable[[int], object] | None = None
    address = 0

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # at interpreter exit the CUDA runtime and this module's globals may be gone: the driver unlocks at exit
        if self.unlock is not None and not _finalizing():
            try:
                self.unlock(self.address)
            except Exception:  # a finalizer must not raise; the driver unlocks at exit
                pass


def pinned_zeros(
    numel: int, dtype: torch.dtype, registry: HostRegistry | None = None, fallback: bool = True
) -> torch.Tensor:
    """A zero-filled, pinned host tensor of exactly `numel` elements ([Note: pinned memory without rounding]). If the
    driver refuses the registration, torch's allocator pins it instead (warned once), or, without `fallback`, a
    ZeroshardError says why."""
    nbytes = numel * dtype.itemsize
    if nbytes < EXACT_FROM or os.environ.get("ZEROSHARD_PINNED", "").lower() == "torch":
        return torch.zeros(numel, dtype=dtype, pin_memory=True)
    registry = registry or cuda_registry()
    mapping = _Mapping(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_DONTFORK"):  # not shared copy-on-write with a forked child (see the note)
        mapping.madvise(mmap.MADV_DONTFORK)
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel)
    error = registry.register(tensor.data_ptr(), nbytes)
    if error is None:
        mapping.unlock, mapping.address = registry.unregister, tensor.data_ptr()
        return tensor
    refusal = (
        f"registering {nbytes / 2**30:.2f} GiB of host memory for offloaded state failed ({error}); free host memory "
        "or raise a locked-memory limit (`ulimit -l unlimited`, the container's memlock)"
    )
    if not fallback:
        raise ZeroshardError(refusal)
    _warn_once(
        f"{refusal}: pinning through torch's allocator instead, which rounds each tensor up to a power of two (up to "
        "twice the host memory); ZEROSHARD_PINNED=torch does so without trying"
    )
    return torch.zeros(numel, dtype=dtype, pin_memory=True)


@cache
def _warn_once(message: str) -> None:
    logger.warning(message)
