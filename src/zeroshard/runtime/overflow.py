"""`deepspeed.runtime.utils.CheckOverflow` and the norm helpers beside it, for scripts that check their own
gradients (Megatron-style fp16 loops, DeepSpeed's own tests). The engine checks its gradients itself
(precision/loss_scaler.py); these are for gradients the script holds in `p.grad`.

[Note: a script's expert parameters]
DeepSpeed marks an expert's parameters `param.allreduce = False` and reads the mark back. zeroshard bolts nothing
onto parameters and finds experts from the model's MoE layers, but a script (or DeepSpeed's tests) that sets the
mark itself means it: a parameter carrying `allreduce=False` is an expert's here too, and an overflow in one is
then agreed over the largest expert-parallel group (`utils.groups`), as DeepSpeed agrees it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.accelerator import get_accelerator
from zeroshard.comm import api as comm
from zeroshard.precision.loss_scaler import has_inf_or_nan


def is_invalid_grad_norm(norm: float | torch.Tensor) -> bool:
    """Whether a gradient norm says overflow: not finite, or negative (`get_weight_norm`'s -1), as DeepSpeed's.

    Example:
        >>> is_invalid_grad_norm(-1), is_invalid_grad_norm(2.0)
        (True, False)
    """
    if isinstance(norm, torch.Tensor):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


def get_global_norm(norm_list: Iterable[float]) -> float:
    """The 2-norm of several norms (inf if any is invalid), as DeepSpeed's `get_global_norm`.

    Example:
        >>> get_global_norm([3.0, 4.0])
        5.0
    """
    norms = list(norm_list)
    if any(is_invalid_grad_norm(norm) for norm in norms):
        return float("inf")
    return math.sqrt(sum(float(norm) ** 2.0 for norm in norms))


def _is_expert(param: torch.Tensor) -> bool:
    """[Note: a script's expert parameters]."""
    return getattr(param, "allreduce", True) is False


class CheckOverflow:
    """DeepSpeed's overflow check over the gradients (`p.grad`) of `param_groups` (lists of parameters), agreed
    across the ranks that hold parts of one model: the largest expert-parallel group when an expert's parameter is
    among them ([Note: a script's expert parameters]), the `mpu`'s model-parallel group (and its data-parallel group
    when the engine given as `deepspeed` leaves gradients unreduced), the world with `zero_reduce_scatter`. Every
    rank of those groups must call it.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> layer(torch.ones(1, 2)).sum().backward()
        >>> CheckOverflow([list(layer.parameters())]).check()
        False
    """

    def __init__(
        self,
        param_groups: Sequence[Iterable[torch.Tensor]] | None = None,
        mpu: Any = None,
        zero_reduce_scatter: bool = False,
        deepspeed: Any = None,
    ) -> None:
        self.mpu = mpu
        self.zero_reduce_scatter = zero_reduce_scatter
        self.deepspeed = deepspeed
        self.params: list[torch.Tensor] | None = [p for group in param_groups for p in group] if param_groups else None
        self.has_moe_params = any(_is_expert(p) for p in self.params or ())

    def check_using_norm(self, norm_group: Iterable[float | torch.Tensor], reduce_overflow: bool = True) -> bool:
        """Overflow as given norms say it (`is_invalid_grad_norm`), agreed as DeepSpeed agrees it: over the expert
        group, then the mpu's model-parallel group, or the world when `reduce_overflow` and there is no mpu."""
        flag = self._flag(any(is_invalid_grad_norm(norm) for norm in norm_group), torch.float32)
        if self.has_moe_params:
            self._agree(flag, self._expert_group())
        if self.mpu is not None:
            self._agree(flag, self.mpu.get_model_parallel_group())
        elif reduce_overflow:
            self._agree(flag, None)
            comm.barrier()
        return bool(flag.item())

    def check(self, param_groups: Sequence[Iterable[torch.Tensor]] | None = None) -> bool:
        """Overflow in the gradients of `param_groups` (those given at construction when None)."""
        if param_groups is None:
            return self.has_overflow(self.params or [], has_moe_params=self.has_moe_params)
        params = [p for group in param_groups for p in group]
        return self.has_overflow(params, has_moe_params=any(_is_expert(p) for p in params))

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether this rank's gradients of `params` hold an inf or a nan (no collective)."""
        return has_inf_or_nan(p.grad.detach() for p in params if p.grad is not None)

    def has_overflow(self, params: Iterable[torch.Tensor], has_moe_params: bool | None = None) -> bool:
        """This rank's answer (`has_overflow_serial`) agreed across the groups the class docstring names."""
        flag = self._flag(self.has_overflow_serial(params), torch.uint8)
        if self.has_moe_params if has_moe_params is None else has_moe_params:
            self._agree(flag, self._expert_group())
        engine_reduces = self.deepspeed is None or self._engine_reduces_gradients()
        if self.zero_reduce_scatter:
            self._agree(flag, None)
        elif self.mpu is not None:
            if not engine_reduces:
                self._agree(flag, self.mpu.get_data_parallel_group())
            self._agree(flag, self.mpu.get_model_parallel_group())
        elif not engine_reduces:
            self._agree(flag, None)
        return bool(flag.item())

    def _engine_reduces_gradients(self) -> bool:
        """DeepSpeed's test: a pipeline engine's `pipeline_enable_backward_allreduce`, else
        `enable_backward_allreduce` (both True unless the script turned reduction off)."""
        if hasattr(self.deepspeed, "pipeline_enable_backward_allreduce"):
            return self.deepspeed.pipeline_enable_backward_allreduce is not False
        return getattr(self.deepspeed, "enable_backward_allreduce", True) is not False

    @staticmethod
    def _flag(value: bool, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([float(value)], dtype=dtype, device=get_accelerator().current_device_name())

    @staticmethod
    def _agree(flag: torch.Tensor, group: Any) -> None:
        if comm.is_available() and comm.is_initialized():
            comm.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)

    @staticmethod
    def _expert_group() -> dist.ProcessGroup | None:
        from zeroshard.utils import groups

        return groups._get_max_expert_parallel_group()


__all__ = ["CheckOverflow", "get_global_norm", "is_invalid_grad_norm"]
