"""`engine.offload_states()` / `reload_states()`: move master weights and optimizer state off the
device between phases (evaluation, generation) and back, keeping every tensor's identity.

The tensors keep their Python objects and storages: the bytes are copied to host buffers and the
device storage is resized to zero, then resized back and refilled on reload, so the optimizer's
state dict, its parameter keys and every view (stage-3 master pieces) stay valid.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zeroshard.errors import ZeroshardError
from zeroshard.offload.pinned import pinned_zeros


class StateOffloader:
    def __init__(self) -> None:
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []
        # pinned host copies kept after a reload for the next offload (an RL loop offloads every iteration): exact
        # size ([Note: pinned memory without rounding]), registered once, as DeepSpeed keeps its pinned buffers
        self._spare: list[torch.Tensor] = []

    @property
    def active(self) -> bool:
        return bool(self._held)

    @property
    def host_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for _, h in self._held)

    def offload(
        self, tensors: Iterable[torch.Tensor], device: torch.device, pin_memory: bool, non_blocking: bool
    ) -> None:
        if self._held:
            raise ZeroshardError("offload_states() called twice; call reload_states() first")
        seen: set[int] = set()
        pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            base = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage)
            if pin:
                host = self._pinned(base.numel(), base.dtype)
            else:
                host = torch.empty(base.shape, dtype=base.dtype, device=device)
            host.copy_(base, non_blocking=non_blocking)
            self._held.append((base, host))
        self._settle(non_blocking)
        for base, _ in self._held:
            base.untyped_storage().resize_(0)

    def reload(self, non_blocking: bool = False) -> None:
        for base, host in self._held:
            base.untyped_storage().resize_(host.numel() * host.element_size())
            base.data.copy_(host, non_blocking=non_blocking)
        self._settle(non_blocking)
        self._spare = [host for _, host in self._held if host.is_pinned()]
        self._held.clear()

    def _pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        for i, spare in enumerate(self._spare):
            if spare.numel() == numel and spare.dtype == dtype:
                return self._spare.pop(i)
        return pinned_zeros(numel, dtype)

    def _settle(self, non_blocking: bool) -> None:
        """The asynchronous copies are done (on the devices the states are on, not only the current one)."""
        if non_blocking and torch.cuda.is_available():
            for device in {base.device for base, _ in self._held if base.is_cuda}:
                torch.cuda.synchronize(device)
