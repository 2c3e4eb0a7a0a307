"""The whole model out of a sharded engine: `save_16bit_model` (and its old name `save_fp16_model`),
`consolidated_state_dict` (from the fp32 masters), and DeepSpeed's `_zero3_consolidated_16bit_state_dict` and
`_consolidated_16bit_state_dict` (which accelerate's `get_state_dict` and OpenRLHF's save call). Every one is
collective: every rank calls it. A mixin of `Engine`."""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.checkpoint.torn import refuse_torn
from zeroshard.errors import ZeroshardError
from zeroshard.linear.engine import whole_base_weights
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


class WholeModelCalls:
    config: Any
    module: torch.nn.Module
    strategy: Any
    precision: Any  # PrecisionPolicy
    _torn_load: Any  # CheckpointMixin's: [Note: a torn load]

    if TYPE_CHECKING:  # Engine's, EngineAccessors' and CheckpointMixin's

        @property
        def zero_stage(self) -> int: ...

        @property
        def global_rank(self) -> int: ...

        def autotp_size(self) -> Any: ...

        def _states_back(self, op: str) -> contextlib.AbstractContextManager[None]: ...

    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Write the full model in its compute dtype to `save_dir/save_filename` (rank 0 writes; every rank must call):
        a `.safetensors` name as safetensors (tied weights once, as `save_pretrained` writes them), any other name with
        `torch.save`, as DeepSpeed writes its default `pytorch_model.bin` (every name of the state dict, tied weights
        sharing one tensor). `exclude_frozen_parameters` leaves out the parameters that do not require grad.

        Under stage 3 this needs `zero_optimization.stage3_gather_16bit_weights_on_model_save: true`
        (DeepSpeed's rule), since it gathers the whole model."""
        refuse_torn(self, "save_16bit_model")
        if self.zero_stage == 3 and not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            raise ZeroshardError(
                "save_16bit_model under stage 3 gathers the whole model; set "
                '"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true} to allow it'
            )
        keep = self.global_rank == 0
        state = self.strategy.save_state_dict(keep) if self.strategy is not None else self.module.state_dict()
        # sharded or quantized LoRAOptimizedLinear base weights, whole ([Note: sharded base weights])
        whole = {} if exclude_frozen_parameters else whole_base_weights(self.module)
        if not keep:
            return True
        state.update((key, value) for key, value in whole.items() if key in state)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        tmp = f"{path}.tmp.{os.getpid()}"  # in place once whole: an interrupted save leaves the earlier file
        if save_filename.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file(_safetensors_state(state, live_storages(self.module)), tmp)
        else:
            torch.save(_pickled_state(state, live_storages(self.module)), tmp)
        os.replace(tmp, path)
        return True

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """DeepSpeed's: the whole model in the compute dtype on rank 0's CPU (None on the other ranks) where the
        weights are split: stage 3 (`_zero3_consolidated_16bit_state_dict`) and AutoTP (`tensor_parallel.autotp_size`
        > 1, the slices made whole; buffers too, which DeepSpeed leaves out). Every rank must call it. Where every
        rank holds the whole model it raises ValueError, as DeepSpeed: read `module.state_dict()` there."""
        if self.zero_stage == 3:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if int(self.autotp_size() or 0) > 1 and self.strategy is not None:
            refuse_torn(self, "_consolidated_16bit_state_dict")
            keep = self.global_rank == 0
            with self._states_back("_consolidated_16bit_state_dict"):
                state = self.strategy.save_state_dict(keep)
            if not keep:
                return None
            frozen = set()
            if exclude_frozen_parameters:
                frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            # (a module's extra state that is no tensor passes as it is)
            live = live_storages(self.module)
            return {
                k: on_host(v, live) if isinstance(v, torch.Tensor) else v for k, v in state.items() if k not in frozen
            }
        raise ValueError(
            "consolidated_16bit_state_dict is only applicable to cases where weights are partitioned, including "
            "Zero Stage 3 and tensor parallelism."
        )

    def save_fp16_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """DeepSpeed's old name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def consolidated_state_dict(
        self, dtype: torch.dtype = torch.float32, keep: bool = True, device: torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """The full model from the fp32 master weights (not the bf16/fp16 compute copies), every name of
        `module.state_dict()` included (tied weights under each name, one tensor). Every rank must call it; with
        `keep` False a rank takes part and gets {}; `device`: where the values go (default: where they are)."""
        refuse_torn(self, "consolidated_state_dict")
        with self._states_back("consolidated_state_dict"):  # the masters, which offload_states() may hold
            return self._consolidated(dtype, keep, device)

    def _consolidated(self, dtype: torch.dtype, keep: bool, device: torch.device | None) -> dict[str, torch.Tensor]:
        why = self.strategy.consolidation_refused() if self.strategy is not None else None
        if why:
            raise ZeroshardError(
                f"the whole model cannot be consolidated here: {why}; save_checkpoint keeps every shard"
            )
        masters = self.strategy.consolidated_params(dtype, keep, device) if self.strategy is not None else {}
        out: dict[str, torch.Tensor] = {}
        if not keep:
            return out
        for name, param in self.module.named_parameters(remove_duplicate=False):
            value = masters.get(id(param))
            out[name] = value if value is not None else param.detach().to(device or param.device, dtype, copy=True)
        for prefix, sub in self.module.named_modules(remove_duplicate=False):
            for name, buf in sub.named_buffers(recurse=False):
                if buf is not None and name not in sub._non_persistent_buffers_set:  # as state_dict() does
                    out[f"{prefix}.{name}" if prefix else name] = buf.detach().to(device or buf.device, copy=True)
        return out

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """DeepSpeed's name (accelerate's `get_state_dict` calls it): the full model in the compute dtype on rank 0,
        None on the other ranks; stage 3 only. Every rank must call it."""
        if self.zero_stage != 3:
            raise ValueError("this function requires ZeRO-3 mode")
        refuse_torn(self, "_zero3_consolidated_16bit_state_dict")
        with self._states_back("_zero3_consolidated_16bit_state_dict"):  # (OpenRLHF saves after its offload)
            return self._zero3_consolidated(exclude_frozen_parameters)

    def _zero3_consolidated(self, exclude_frozen_parameters: bool) -> dict[str, Any] | None:
        # unit by unit, each on the CPU of rank 0 as soon as it is whole (DeepSpeed: layer by layer)
        keep = self.global_rank == 0
        whole = self.strategy.whole_state_dict(exclude_frozen_parameters) if self.strategy is not None else None
        if whole is not None:  # MoE layers' experts at stage 3, named per rank: the strategy names each globally
            return whole if keep else None
        state = self.consolidated_state_dict(self.precision.compute_dtype, keep, torch.device("cpu"))
        if not keep:
            return None
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state


def _safetensors_state(state: dict[str, Any], live: set[int]) -> dict[str, torch.Tensor]:
    """The tensors of `state` on the host, tied weights once (safetensors refuses shared memory)."""
    left = [name for name, value in state.items() if not isinstance(value, torch.Tensor)]
    if left:  # a module's extra state that is no tensor (safetensors holds tensors only)
        logger.warning(f"save_16bit_model: {', '.join(left)} left out (not tensors)")
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    unique = {}
    for name, tensor in ((n, t) for n, t in state.items() if isinstance(t, torch.Tensor)):
        # parameters that are views of one flat buffer (stages 0-2) are distinct tensors: the key is the view's own
        # start, shape and dtype
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key in seen:
            continue
        seen.add(key)
        unique[name] = on_host(tensor, live).contiguous()
    return unique


def _pickled_state(state: dict[str, Any], live: set[int]) -> dict[str, Any]:
    """`state` for torch.save: each tensor on the host in a storage of its own (a view of a flat buffer would save the
    whole buffer), tied weights one tensor under each name; other values as they are."""
    copies: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
    out: dict[str, Any] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            out[name] = value
            continue
        key = (value.data_ptr(), tuple(value.shape), value.dtype)
        if key not in copies:
            copies[key] = on_host(value, live).contiguous()
        out[name] = copies[key]
    return out


def live_storages(module: torch.nn.Module) -> set[int]:
    """The storages of `module`'s parameters and buffers (by address): what `on_host` must copy."""
    from torch.distributed.tensor import DTensor

    out = set()
    for tensor in (*module.parameters(), *module.buffers()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # (a DTensor's own storage is no data)
        if local.device.type != "meta":
            out.add(local.untyped_storage().data_ptr())
    return out


def on_host(tensor: torch.Tensor, live: set[int]) -> torch.Tensor:
    """`tensor` on the host in a storage of its own: a copy, unless it is a host tensor that owns all of its storage
    and is none of the module's (`live`): what the fsdp2 and tensor-parallel saves hand over, made for the caller,
    where a second copy would hold the model twice."""
    tensor = tensor.detach()
    storage = tensor.untyped_storage()
    fresh = storage.data_ptr() not in live and storage.nbytes() == tensor.numel() * tensor.element_size()
    return tensor if tensor.device.type == "cpu" and fresh and tensor.is_contiguous() else tensor.to("cpu", copy=True)
