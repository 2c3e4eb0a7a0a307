"""One accelerator object with DeepSpeed's method names, over torch.cuda or the CPU.

DeepSpeed scripts call `get_accelerator().device_name()`, `.synchronize()`, `.manual_seed(...)` and the
memory queries instead of `torch.cuda.*`, so a script written for it runs on CPU as well. We have two
device kinds (CUDA and CPU, the ones `comm/topology.py` picks), so one class with the kind as data serves
both; on CPU the answers are DeepSpeed's CPU accelerator's (name "cpu", backend "gloo", no streams, memory
as the process's resident set size).
"""

from __future__ import annotations

import os
import resource
from contextlib import nullcontext
from typing import Any

import torch


def _rss_bytes() -> int:
    """The process's resident set size (Linux /proc; elsewhere the peak, the best the stdlib knows)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Accelerator:
    """DeepSpeed's accelerator interface (the methods training scripts call) for "cuda" or "cpu".

    Example:
        >>> from zeroshard.accelerator import get_accelerator
        >>> acc = get_accelerator()
        >>> acc.device_name() in ("cuda", "cpu")
        True
    """

    def __init__(self, device_type: str) -> None:
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
        self._name = device_type
        self._peak_rss = 0  # CPU only: DeepSpeed reports the peak RSS seen since the last reset
        self._compile_backend = "inductor"  # engine.compile()'s default, as DeepSpeed's CUDA and CPU accelerators

    @property
    def _cuda(self) -> bool:
        return self._name == "cuda"

    # Device APIs
    def device_name(self, device_index: int | None = None) -> str:
        """'cuda' or 'cuda:<index>' on GPU; always 'cpu' on CPU (as DeepSpeed's CPU accelerator)."""
        if self._cuda and device_index is not None:
            return f"cuda:{device_index}"
        return self._name

    def device(self, device_index: int | None = None) -> Any:
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """The current CUDA device index; on CPU the local rank (DeepSpeed's CPU answer)."""
        if self._cuda:
            return torch.cuda.current_device()
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """CUDA devices visible; on CPU LOCAL_SIZE or LOCAL_WORLD_SIZE, else 1 (DeepSpeed counts NUMA nodes)."""
        if self._cuda:
            return torch.cuda.device_count()
        for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            if int(os.environ.get(name, "0")) > 0:
                return int(os.environ[name])
        return 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        """True on CPU: work is done when the call returns, so scripts skip event timing."""
        return not self._cuda

    # RNG APIs
    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    # Streams/Events: CUDA's classes; None on CPU, as in DeepSpeed (there is nothing to overlap)
    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    # Memory management
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        rss = _rss_bytes()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self.memory_allocated()
        return self._peak_rss

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self.memory_allocated()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else self.max_memory_allocated()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = 0

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            index = torch.cuda.current_device() if device_index is None else device_index  # DeepSpeed's: current
            return torch.cuda.get_device_properties(index).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    # Misc
    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        # DeepSpeed's CPU answer asks oneDNN whether the CPU has fp16 kernels.
        if self._cuda:
            return True
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Page-locked copy on CUDA machines; the tensor itself on CPU (nothing to transfer to)."""
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """The torch.compile backend `engine.compile()` uses by default; one torch knows, else a ValueError."""
        import torch._dynamo  # torch.compile's front end, loaded only when asked for

        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"{backend!r} is not a torch.compile backend here; the backends are {known}")
        self._compile_backend = backend

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"
