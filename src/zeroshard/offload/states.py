"""`engine.offload_states()` / `reload_states()`: move model states off the device between phases (evaluation,
generation, another model's turn in an RL loop) and back, keeping every tensor's identity.

[Note: offloaded states]
DeepSpeed's `offload_states(include=...)` names five kinds of state (`OffloadStateTypeEnum`), and RL frameworks
pass a subset (OpenRLHF: optimizer state, masters and the gradient buckets, keeping the parameters so the model
still generates). A strategy says which of its tensors each kind is (`Strategy.offloadable`):
- `optim_states`: the optimizer's state tensors; `hp_params`: master weights that are tensors of their own;
- `lp_params`: the compute-dtype parameters (stages 0-2: the flat buffers the module's parameters view; stage 3:
  this rank's shards and the persistent unit). While they are away the module's parameters (stage 3: the
  persistent unit's, and every `ds_tensor`) are the same views of the host copies, as DeepSpeed points them at its
  pinned buffers: a view of a storage resized to zero crashes the process when read, and at stages 0-2
  `state_dict()` and the 16-bit saves read the host values (stage 3's gather, and refuse). The engine's forward,
  `generate`, stage 3's gathers and its hooks refuse in one line;
- `lp_grads`: the gradient accumulators and the fp32 gradient copies the step reads (a backward, a forward with
  grad enabled, `zero_grad` and `safe_get_full_grad` refuse while they are away);
- `contiguous_grad_buffer`: the pooled communication buffers, freed and allocated again when next used (DeepSpeed
  keeps no data of its bucket either).
A kind is moved once: a second call moves what the first left (DeepSpeed's `needs_offload`), and `reload_states()`
brings everything back. Steps and checkpoint loads refuse while anything is away; a checkpoint save (OpenRLHF saves
after its offload; DeepSpeed's reads its host copies) brings the states back to the device for itself and moves them out
again (`CheckpointMixin._states_back`), so it needs their device memory for its duration. The bytes are copied to host
buffers and each device storage is resized to zero, then resized back and refilled on reload, so the optimizer's state
dict, its parameter keys and every view (stage-3 master pieces, the module's parameter views) stay valid. State that
lives off the device already (`offload_optimizer`, `offload_param`) stays where it is. A copy that fails part way leaves
nothing moved. On CUDA the freed blocks go back to the driver (`empty_cache`), so another process (an inference engine
sharing the GPU) can use them, and the host copies are exact-size pinned buffers kept for the next offload.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

import torch

from zeroshard.errors import ZeroshardError
from zeroshard.offload.pinned import pinned_zeros


class OffloadStateTypeEnum(str, Enum):  # noqa: UP042 (DeepSpeed's base: str() as DeepSpeed's gives)
    """DeepSpeed's `deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum` (same members and values)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadDeviceEnum(str, Enum):  # noqa: UP042 (as DeepSpeed's)
    """DeepSpeed's `deepspeed.runtime.zero.offload_config.OffloadDeviceEnum` (same members and values)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


KINDS = tuple(kind.value for kind in OffloadStateTypeEnum)
BUFFERS = OffloadStateTypeEnum.contiguous_grad_buffer.value  # nothing to keep: freed, allocated again on use
PARAMS = OffloadStateTypeEnum.lp_params.value
GRADS = OffloadStateTypeEnum.lp_grads.value
OPTIM_STATES = OffloadStateTypeEnum.optim_states.value


def offload_kinds(include: Any) -> tuple[str, ...]:
    """The kinds `include` names (None: all), in DeepSpeed's order; an unknown name is a ZeroshardError."""
    if include is None:
        return KINDS
    if isinstance(include, str | Enum):
        include = [include]
    names = {item.value if isinstance(item, Enum) else item for item in include}
    unknown = sorted(str(name) for name in names if name not in KINDS)
    if unknown:
        raise ZeroshardError(
            f"offload_states(include=...): unknown state {', '.join(unknown)}; the states are {', '.join(KINDS)} "
            "(deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum)"
        )
    return tuple(kind for kind in KINDS if kind in names)


def offload_device(device: Any) -> torch.device | None:
    """The host device `offload_states(device=...)` names; None for OffloadDeviceEnum.none (nothing moves)."""
    name = device.value if isinstance(device, Enum) else str(device)
    if name == OffloadDeviceEnum.none.value:
        return None
    if name != OffloadDeviceEnum.cpu.value:
        raise ZeroshardError(
            f"offload_states(device={name!r}): states move to host memory only (device='cpu'), as in DeepSpeed; "
            "keep state on NVMe for the whole run with zero_optimization.offload_optimizer/offload_param"
        )
    return torch.device("cpu")


class StateOffloader:
    """The host copies of one engine's offloaded states ([Note: offloaded states])."""

    def __init__(self) -> None:
        self._held: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (kind, device tensor, host copy)
        self._hosts: dict[int, torch.Tensor] = {}  # host copy by the moved storage's identity (`_cdata`)
        self.kinds: frozenset[str] = frozenset()  # what was asked for since the last reload (moved once)
        # pinned host copies kept after a reload for the next offload (an RL loop offloads every iteration): exact
        # size ([Note: pinned memory without rounding]), registered once, as DeepSpeed keeps its pinned buffers
        self._spare: list[torch.Tensor] = []
        self._viewed: set[int] = set()  # spares the parameters viewed while away: reused once no one else holds them

    @property
    def active(self) -> bool:
        return bool(self._held)

    def holds(self, kind: str) -> bool:
        """Whether `kind`'s tensors are away in host copies now."""
        return any(held == kind for held, _, _ in self._held)

    def host_bytes(self) -> dict[str, int]:
        """Bytes held in host memory, by kind."""
        out: dict[str, int] = {}
        for kind, _, host in self._held:
            out[kind] = out.get(kind, 0) + host.numel() * host.element_size()
        return out

    @property
    def pinned(self) -> bool:
        """Whether the host copies are pinned (what `offload_states(pin_memory=...)` gave, where pinning exists)."""
        return any(host.is_pinned() for _, _, host in self._held)

    @property
    def spare_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._spare)

    def offload(
        self,
        tensors: Mapping[str, Sequence[torch.Tensor]],
        kinds: Sequence[str],
        device: torch.device,
        pin_memory: bool,
        non_blocking: bool,
    ) -> set[str]:
        """Copy the tensors of `kinds` not asked for yet (`tensors`: by kind) to `device` and free their storages;
        returns the kinds of which this call moved something. Nothing is freed unless every copy was made."""
        kinds = [kind for kind in kinds if kind not in self.kinds]
        seen = {base.untyped_storage().data_ptr() for _, base, _ in self._held}
        pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
        added: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        try:
            for kind in kinds:
                for tensor in tensors.get(kind, ()):
                    storage = tensor.untyped_storage()
                    if storage.nbytes() == 0 or storage.data_ptr() in seen or not storage.resizable():
                        continue  # (a storage that cannot be resized, memory it does not own, cannot be freed)
                    seen.add(storage.data_ptr())
                    base = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage)
                    host = self._host(base, device, pin)
                    added.append((kind, base, host))
                    host.copy_(base, non_blocking=non_blocking)
            _settle([base for _, base, _ in added], non_blocking)
        except BaseException:
            _settle([base for _, base, _ in added], non_blocking)
            self._spare += [host for _, _, host in added if host.is_pinned()]
            raise
        for _, base, host in added:
            self._hosts[base.untyped_storage()._cdata] = host
            base.untyped_storage().resize_(0)
        self._held += added
        self.kinds |= set(kinds)
        return {kind for kind, _, _ in added}

    def reload(self, non_blocking: bool = False) -> None:
        """Every storage back at its size and refilled from its host copy."""
        for _, base, host in self._held:
            base.untyped_storage().resize_(host.numel() * host.element_size())
            base.data.copy_(host, non_blocking=non_blocking)
        _settle([base for _, base, _ in self._held], non_blocking)
        # kept for the next offload; the parameters' copies, which the parameters viewed while away, only once no
        # one else holds them (a state_dict() taken then: reused for another tensor, its values would change)
        self._spare += [host for _, _, host in self._held if host.is_pinned()]
        self._viewed |= {id(host) for kind, _, host in self._held if kind == PARAMS}
        self._held.clear()
        self._hosts.clear()
        self.kinds = frozenset()

    def host_view(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """`tensor`, a view of a storage this offloader moved, as the same view of its host copy (None: not moved)."""
        host = self._hosts.get(tensor.untyped_storage()._cdata)
        if host is None or host.dtype != tensor.dtype:
            return None
        return host.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())

    def _free(self, spare: torch.Tensor) -> bool:
        """Whether no one but this offloader holds `spare`: always for state the module never viewed."""
        if id(spare) not in self._viewed:
            return True
        count = getattr(torch._C, "_storage_Use_Count", None)  # (the storage object asked for counts once)
        return count is not None and int(count(spare.untyped_storage()._cdata)) <= 2

    def release(self) -> None:
        """Drop the spare pinned buffers (the engine is destroyed)."""
        self._spare.clear()

    def _host(self, base: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
        if pin:
            for i, spare in enumerate(self._spare):
                if spare.numel() == base.numel() and spare.dtype == base.dtype and self._free(spare):
                    return self._spare.pop(i)
            return pinned_zeros(base.numel(), base.dtype)
        return torch.empty(base.shape, dtype=base.dtype, device=device)


def _settle(bases: list[torch.Tensor], non_blocking: bool) -> None:
    """The asynchronous copies are done (on the devices the states are on, not only the current one)."""
    if non_blocking and torch.cuda.is_available():
        for device in {base.device for base in bases if base.is_cuda}:
            torch.cuda.synchronize(device)
